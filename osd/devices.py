"""Copies between host and device on the decode path.

Host-to-device copies that do not wait: the one helper every hot-path index tensor uses. A
pageable host-to-GPU copy synchronises with the device's stream; a pinned one with
``non_blocking`` does not, which keeps the decode loop at one host sync per step. And back: a
step's per-row outputs come to the host once, as arrays the rows slice.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["on_host", "to_device"]


def on_host(*tensors: torch.Tensor) -> tuple[np.ndarray, ...]:
    """The tensors as host arrays: views on the CPU; elsewhere ``non_blocking`` copies, which
    need not have landed when this returns, so call it before the step's host sync and read
    the arrays after it (the sync waits for the copies, queued before it on the same stream).
    A row's share of a batch tensor is then a slice that dispatches nothing."""
    return tuple(
        (t if t.device.type == "cpu" else t.to("cpu", non_blocking=True)).numpy() for t in tensors
    )


def to_device(values: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``values`` (a CPU tensor) on ``device``, without a host sync on CUDA."""
    if torch.device(device).type == "cuda":
        return values.pin_memory().to(device, non_blocking=True)
    return values.to(device)
