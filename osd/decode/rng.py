"""Counter-based random streams: a uniform is a pure function of (key, counter).

Each request has two keys (drafting and verification) derived from its seed; the draws of a
step are addressed by (step, branch, position), so a row gets the same numbers whatever else
shares its batch, and a whole batch's draws are one vectorised call on the device (no
per-row ``torch.Generator``). The mixer is splitmix64's finaliser (Steele et al. 2014), which
passes BigCrush on sequential counters; int64 arithmetic wraps around in torch on CPU and GPU.
"""

from __future__ import annotations

import torch

__all__ = ["DRAFT_STREAM", "VERIFY_STREAM", "counter", "step_uniforms", "stream_key", "uniforms"]

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB

DRAFT_STREAM = 1
VERIFY_STREAM = 2

# Counter layout: step << 20 | branch << 10 | position (k and K stay below 1024).
_BRANCH_SHIFT = 10
_STEP_SHIFT = 20


def _signed(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _mix_int(z: int) -> int:
    z = ((z ^ (z >> 30)) * _M1) & _MASK64
    z = ((z ^ (z >> 27)) * _M2) & _MASK64
    return z ^ (z >> 31)


def stream_key(seed: int, stream: int) -> int:
    """The 64-bit key (as a signed int64) of one of a request's streams.

    Every bit of a seed in [-2^127, 2^127) counts, its sign included: the seed is read as a
    128-bit unsigned number and both halves are mixed in.
    """
    unsigned = seed % (1 << 128)
    z = _mix_int(_mix_int(unsigned & _MASK64) ^ (unsigned >> 64))
    return _signed(_mix_int((z + stream * _GOLDEN) & _MASK64))


def counter(step: torch.Tensor | int, branch: torch.Tensor | int, position: torch.Tensor | int):
    """Counter of the draw for (step, branch, position); broadcasts over tensors."""
    return (step << _STEP_SHIFT) + (branch << _BRANCH_SHIFT) + position


_S_M1, _S_M2, _S_GOLDEN = _signed(_M1), _signed(_M2), _signed(_GOLDEN)


def _srl(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def uniforms(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """U[0, 1) float64 draws, one per (key, counter) pair.

    Args:
        keys: (B,) int64 stream keys (:func:`stream_key`).
        counters: (B, ...) int64 counters (:func:`counter`).

    Returns:
        (B, ...) float64 in [0, 1), 53 random bits each.
    """
    keys = keys.reshape(keys.shape + (1,) * (counters.dim() - 1))
    z = keys + counters * _S_GOLDEN
    z = (z ^ _srl(z, 30)) * _S_M1
    z = (z ^ _srl(z, 27)) * _S_M2
    z = z ^ _srl(z, 31)
    return _srl(z, 11).to(torch.float64) * (1.0 / (1 << 53))


def step_uniforms(
    keys: torch.Tensor, steps: torch.Tensor, num_branches: int, num_positions: int
) -> torch.Tensor:
    """One step's draws of every row: (B,) keys and steps -> (B, branches, positions)."""
    device = keys.device
    return uniforms(
        keys,
        counter(
            steps.view(-1, 1, 1),
            torch.arange(num_branches, device=device).view(1, -1, 1),
            torch.arange(num_positions, device=device).view(1, 1, -1),
        ),
    )
