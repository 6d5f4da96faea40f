"""Scale-out: engine replicas on Ray Serve (`deploy`), prefix-affinity routing (`ring`, `router`),
sharing one remote KV tier (cache.host.lmcache.remote_url). `ring` needs no Ray; the rest does
(the `ray` extra)."""
