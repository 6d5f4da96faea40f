"""The KV tiers' worker side: what a forward does with the blocks the scheduler side chose.

The scheduler side (`KVTiers`) looks up, allocates, pins and indexes; a `Prepared` request then
names every block by id. The worker side runs the host tier's planned loads into their blocks
(`load`: LMCache's chunks copied, its disk files read), gives the forward the cached prefix to
read in place by block id (`prefix_kv`) and a sink for the K,V it computes (`sink`: retained
blocks written into the pool once, stored chunks copied into LMCache's memory). It never looks up,
allocates, pins or indexes: a load that fails is reported, and the scheduler side takes its blocks
back (`KVTiers.abort`). LMCache's vLLM connector splits its calls the same way.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import Tensor

from tiered.hybrid.forward import KVSink
from tiered.offload.device_tier import DeviceTier, PrefixKV
from tiered.offload.host_base import Host
from tiered.offload.loading import copy_chunks
from tiered.request.plan import HostLoad, Prepared


class KVWorker:
    """Loads, prefix reads and KV writes by block id, for the requests the scheduler side prepared.
    `copy_stream` (cuda): the side stream the sink's device-to-host copies run on."""

    def __init__(
        self, device_tier: DeviceTier, host_tier: Host | None, num_layers: int, copy_stream: torch.cuda.Stream | None
    ) -> None:
        self.device_tier, self.host_tier, self.num_layers = device_tier, host_tier, num_layers
        self.block_tokens = device_tier.block_tokens
        self._copy_stream = copy_stream

    def load(self, prepared: Sequence[Prepared]) -> list[HostLoad]:
        """Run the planned host loads of these requests (each once, whatever else happens to its
        request: another request may read its blocks); returns those that filled fewer blocks than
        planned (a chunk could not be read), whose readers must not run. Each request's load time
        is added to its `load_seconds`."""
        failed = []
        for p in prepared:
            for load in p.loads:
                if load.filled is not None:
                    continue
                assert self.host_tier is not None
                start = time.perf_counter()
                copy_chunks(self.host_tier, self.device_tier, load)
                p.load_seconds += time.perf_counter() - start
                if load.failed:
                    failed.append(load)
        return failed

    def prefix_kv(self, prepared: Prepared) -> PrefixKV | None:
        """The request's cached prefix as the forward reads it, by block id, a layer at a time (None: no prefix)."""
        if not prepared.prefix_blocks:
            return None
        return PrefixKV(self.device_tier, prepared.prefix_blocks, self.num_layers)

    def sink(self, prepared: Prepared) -> KVSink:
        """The forward's KV sink: keep retained blocks on the device, copy stored chunks into LMCache memory."""
        bt = self.block_tokens
        retained = prepared.retained_blocks
        store = prepared.store
        stream = self._copy_stream
        first_computed = prepared.num_prefix_tokens
        first_retained = prepared.first_retained_block * bt - first_computed
        rows = [j * bt - first_computed for j in prepared.stored_blocks]

        def sink(layer: int, k: Tensor, v: Tensor) -> None:
            # k, v: [new tokens, Hkv, Dh]; token 0 is the first computed one (a block boundary).
            if retained:
                s, e = first_retained, first_retained + len(retained) * bt
                self.device_tier.write_layer(layer, retained, k[s:e], v[s:e])
            if store is None:
                return
            start = time.perf_counter()
            if stream is None:
                store.write_layer(layer, k, v, rows)
            else:
                stream.wait_stream(torch.cuda.current_stream(stream.device))
                with torch.cuda.stream(stream):
                    store.write_layer(layer, k, v, rows, non_blocking=True)
                k.record_stream(stream)  # the forward frees k, v after this call
                v.record_stream(stream)
            prepared.store_copy_seconds += time.perf_counter() - start

        return sink
