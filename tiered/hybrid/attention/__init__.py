"""Attention for the hybrid forward: one interface (`kernels.py`), several kernels, the fastest
correct one chosen per machine (`select.py`)."""

import torch

from tiered.hybrid.attention import vllm_cpu
from tiered.hybrid.attention.kernels import KERNELS, AttendFn, Kernel, Piece, reference_

# vllm_cpu imports Kernel and Piece from kernels, so it joins KERNELS here rather than there.
KERNELS[vllm_cpu.KERNEL.name] = vllm_cpu.KERNEL

# What a model computes with until the engine measures (tests and benchmarks that call the forward directly).
DEFAULT_KERNEL = {"cpu": "flash-head", "cuda": "masked"}


def default_kernel(device: str) -> str:
    return DEFAULT_KERNEL.get(torch.device(device).type, "masked")


__all__ = ["DEFAULT_KERNEL", "KERNELS", "AttendFn", "Kernel", "Piece", "default_kernel", "reference_"]
