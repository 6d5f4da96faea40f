"""The LoRA adapters an engine serves: checked folders by name, weights resident up to `max_loras`.

Names map to checked specs (`hybrid/lora.py`); a request is bound to its adapter's identity (a
hash of its files) when it is submitted, so unloading or replacing a name does not change what a
waiting request computes (it still runs with the adapter it asked for), and two different
adapters never share cached KV. Weights are read onto the device when a batch needs them, and
the files are hashed again as they are read: a folder changed since it was checked fails its
requests instead of serving other weights under the old identity. Beyond `max_loras`, the least
recently used adapter not in the batch is dropped (and read again when next asked for).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from tiered.config import LoraConfig
from tiered.hybrid.args import ModelArgs
from tiered.hybrid.forward import ForwardInputError
from tiered.hybrid.lora import AdapterError, AdapterSpec, LoraWeights, load_adapter, read_adapter

log = logging.getLogger(__name__)


class UnknownAdapterError(ForwardInputError):
    """A request or command named an adapter the engine does not serve (HTTP 404)."""

    status = 404


@dataclass(slots=True)
class AdapterStats:
    """Counters of the served LoRA adapters: how many, how many resident, their loads and evictions."""

    num_adapters: int = 0  # names served now
    num_resident: int = 0  # adapters whose weights are on the device
    num_loads: int = 0  # weight reads from a folder (first use, or again after an eviction)
    num_evictions: int = 0
    load_seconds: float = 0.0


class Adapters:
    """Not thread-safe: the engine's loop is its one caller."""

    def __init__(
        self, config: LoraConfig, args: ModelArgs, dtype: torch.dtype, device: str, first_layer: int = 0
    ) -> None:
        """`first_layer`: a pipeline stage's, whose `args.num_layers` layers start there in the model
        (its adapters hold those layers' weights only)."""
        self.args, self.dtype, self.device, self.first_layer = args, dtype, device, first_layer
        self.max_loras, self.max_rank = config.max_loras, config.max_lora_rank
        self._by_name: dict[str, AdapterSpec] = {}
        self._by_identity: dict[str, AdapterSpec] = {}  # every adapter ever added (waiting requests use them)
        self._resident: OrderedDict[str, LoraWeights] = OrderedDict()  # by identity, least recent first
        self._stats = AdapterStats()
        for name, path in config.modules.items():
            self.add(name, path)

    def add(self, name: str, path: str | Path) -> AdapterSpec:
        """Check and register an adapter folder (weights are read on first use)."""
        if name in self._by_name:
            raise AdapterError(f"The lora adapter '{name}' has already been loaded.")
        spec = read_adapter(name, path, self.args, self.max_rank)
        self._by_name[name] = spec
        self._by_identity[spec.identity] = spec  # the newest folder with these files
        log.info("LoRA adapter '%s' from %s: rank %d on %s", name, spec.path, spec.rank, ", ".join(spec.target_modules))
        return spec

    def remove(self, name: str) -> AdapterSpec:
        """Stop serving `name`; requests already waiting for it still run."""
        spec = self._by_name.pop(name, None)
        if spec is None:
            raise UnknownAdapterError(f"The lora adapter '{name}' cannot be found.")
        if spec.identity not in {s.identity for s in self._by_name.values()}:
            self._resident.pop(spec.identity, None)
        log.info("LoRA adapter '%s' unloaded", name)
        return spec

    def spec(self, name: str) -> AdapterSpec:
        """The checked adapter served under `name` (UnknownAdapterError if none)."""
        spec = self._by_name.get(name)
        if spec is None:
            raise UnknownAdapterError(f"The model `{name}` does not exist.")
        return spec

    def know(self, spec: AdapterSpec) -> None:
        """Accept a folder another process checked (a pipeline stage: its coordinator's adapters),
        by identity, without a name to serve it under."""
        self._by_identity.setdefault(spec.identity, spec)

    def spec_of(self, identity: str) -> AdapterSpec:
        """The adapter folder with this identity (every adapter ever added: waiting requests use them)."""
        return self._by_identity[identity]

    @property
    def names(self) -> list[str]:
        """The adapter names served now."""
        return list(self._by_name)

    def load(self, identities: Iterable[str]) -> dict[str, str]:
        """Make these adapters resident (read now if not); returns {identity: why} for those whose
        folder can no longer be read as it was checked (changed or deleted since)."""
        wanted = list(dict.fromkeys(identities))
        if len(wanted) > self.max_loras:
            raise ValueError(f"a batch needs {len(wanted)} adapters; lora.max_loras is {self.max_loras}")
        failed = {}
        for identity in wanted:
            if identity in self._resident:
                self._resident.move_to_end(identity)
                continue
            start = time.perf_counter()
            try:
                self._resident[identity] = load_adapter(
                    self._by_identity[identity], self.args.num_layers, self.dtype, self.device, self.first_layer
                )
            except AdapterError as exc:
                failed[identity] = str(exc)
                continue
            self._stats.num_loads += 1
            self._stats.load_seconds += time.perf_counter() - start
        for identity in list(self._resident):
            if len(self._resident) <= self.max_loras:
                break
            if identity not in wanted:
                del self._resident[identity]
                self._stats.num_evictions += 1
        return failed

    def weights(self, identity: str) -> LoraWeights:
        """A resident adapter's weights (`load` made it resident)."""
        return self._resident[identity]

    def stats(self) -> AdapterStats:
        """A snapshot of the adapter counters, with the current served and resident counts."""
        s = self._stats
        return AdapterStats(len(self._by_name), len(self._resident), s.num_loads, s.num_evictions, s.load_seconds)
