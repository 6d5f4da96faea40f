"""Pipeline-parallel prefill: the decoder layers split over S stage processes (`engine.pipeline_stages`).

Processes. The engine (scheduler, block index, the tiers' bookkeeping) stays in the coordinating
process, with one view of what is cached. Stage s is a process of its own (spawned) that holds
layers `stage_layers(L, S)[s]` (the embedding on stage 0, the final norm and LM head on the
last) and a KV pool for those layers only, indexed by the SAME block ids as the coordinator's
device tier (`DeviceTier(hold_kv=False)`: the index without a pool). The coordinator allocates,
pins and evicts; a stage reads its prefixes and writes its retained blocks at the ids it is told.
So a block is a hit on every stage or on none, by construction, and an eviction decided once
applies everywhere (the next writer of a freed id overwrites it on every stage).

Messages. Per batch the coordinator sends every stage the same `Forward` over a Pipe: the
micro-batches, each a list of `runner.ItemPlan` (the tokens each request computes, its prefix
block ids, its lead and shared tokens, its retained block ids and where they start, its LoRA
adapter) and the adapters' folders (each stage reads its layers' part). Stage 0
embeds the tokens and runs its layers; it sends the residual stream of the computed tokens
[N, D] to stage 1, ..., and the last stage computes the norm and LM head at each request's last
token and answers the coordinator with the logits [B, V]. With `pipeline_schedule: waves` a
batch is cut into micro-batches of even predicted seconds on the slowest stage (`costs.py`'s
stage models, cut as `scheduler/waves.py` does), sent with
non-blocking sends: stage s computes micro-batch i + 1 while stage s + 1 computes micro-batch i.
`fill-drain` sends the batch as one micro-batch (GPipe's baseline: one stage busy at a time).

Batches back to back. With waves, up to `pipeline_batches_in_flight` batches (default S + 1) are in
the pipe at once: the engine plans and sends the next batch while the last stages still compute
the one before, so the first stage does not idle while the pipe drains. The next batch is
planned from what the one before will have left: its retained blocks are indexed when it is
sent, which is safe because every stage takes batches in the order sent (a block is written on a
stage before any later batch reads it there); pins keep the blocks a batch in the pipe reads
from being reused. A stage reads the coordinator's Pipe in a thread of its own (a batch's plans
can fill the Pipe's buffer while the stage computes) and does not wait for its sends to the next
stage to complete before it starts the next micro-batch.

Transport. Activations go stage to stage over `torch.distributed` point-to-point send/recv (the
gloo backend on CPU; NCCL with one device per stage on CUDA: the same code, the backend follows
the device). Point-to-point send/recv moves a tensor's raw buffer into one the receiver
preallocated (no pickling), non-blocking sends let a stage compute while its last output
travels, it comes with torch (no new dependency), and the same code runs on NCCL, the fast path
between GPUs. Ray's channels (compiled graphs) would do the same, but they bring Ray into every
engine (today only `tiered serve --replicas` uses it) and a second scheduler of processes.
Control messages and logits go over multiprocessing Pipes: small, and a Pipe's end tells the
coordinator when a stage process dies.

Start-up and memory. The coordinator holds no weights: it reads the model's args and builds its
modules on the meta device (the attention kernel's choice needs only the shapes). Each stage
loads its layers and reports what it holds (`StageLoaded`); with `engine.memory_budget_bytes`,
each stage's budget, it also runs a profile forward of max_model_len tokens through its layers
(from token ids on stage 0, from a residual stream on later stages) and reports its peak,
weights included. The coordinator then decides one number of blocks for every pool, as block ids
are shared: the fewest any stage has room for, (budget - its peak) // its bytes per block; a
stage whose peak reaches the budget fails the start, named with its layers and bytes. Without a
budget the pools split `cache.device_tier_bytes` by their layers. Each stage then allocates its
pool (`AllocatePool`, answered by `StageReady`) and the coordinator builds its index of that
many blocks. So a model whose weights exceed one budget serves on stages that each hold a part.
The JCT model is profiled through the stages (`engine.forward`: the time a batch takes end to
end), after the pipeline has started; every stage reports the seconds of each micro-batch it
runs, and one model per stage (`costs.py`: the profile scaled by its share of the layers, then
what it reports) predicts a micro-batch on it: the weights the micro-batch cut balances.

Failure. A stage that dies (or raises), or gives no answer within `engine.pipeline_timeout_s`
(alive but stuck), fails every batch in the pipe: the coordinator kills the stages, starts a new
pipeline, forgets the device tier's contents (the pools are gone) and raises
`runner.ForwardUnavailable`, which the engine turns into a 503 for each request of those batches.

The host tier. With `cache.suffix: offload` each stage keeps its layers' chunks in an LMCache
tier of its own and the coordinator keeps the one index that decides hits, stores and
evictions; each batch's `Forward` carries what every stage's tier does with it (`host.py`).

Not yet: the host tier's disk and remote backends with stages, `forward.mode: chunked`, and
replicas of a pipeline.
"""

from tiered.pipeline.runner import PipelineRunner, PipelineStartError, start_pipeline
from tiered.pipeline.split import cut_microbatches, stage_layers

__all__ = ["PipelineRunner", "PipelineStartError", "cut_microbatches", "stage_layers", "start_pipeline"]
