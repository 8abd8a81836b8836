"""Host-to-device copies that do not wait: the one helper every hot-path index tensor uses.

A pageable host-to-GPU copy synchronises with the device's stream; a pinned one with
``non_blocking`` does not, which keeps the decode loop at one host sync per step.
"""

from __future__ import annotations

import torch

__all__ = ["to_device"]


def to_device(values: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``values`` (a CPU tensor) on ``device``, without a host sync on CUDA."""
    if torch.device(device).type == "cuda":
        return values.pin_memory().to(device, non_blocking=True)
    return values.to(device)
