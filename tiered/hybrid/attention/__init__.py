"""Attention for the hybrid forward: one interface (`kernels.py`), several kernels, the fastest
correct one chosen per machine (`select.py`)."""

import torch

from tiered.hybrid.attention.interface import AttendFn, Kernel, Span
from tiered.hybrid.attention.kernels import KERNELS, reference_

# What a model computes with until the engine measures (tests and benchmarks that call the forward directly).
DEFAULT_KERNEL = {"cpu": "flash-head", "cuda": "masked"}


def default_kernel(device: str) -> str:
    """The kernel a model uses on `device` before the engine has measured which is fastest."""
    return DEFAULT_KERNEL.get(torch.device(device).type, "masked")


__all__ = ["DEFAULT_KERNEL", "KERNELS", "AttendFn", "Kernel", "Span", "default_kernel", "reference_"]
