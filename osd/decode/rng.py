"""Counter-based random streams: a uniform is a pure function of (key, counter).

Each request has two keys (drafting and verification) derived from its seed; the draws of a
step are addressed by (step, branch, position), so a row gets the same numbers whatever else
shares its batch, and a whole batch's draws are one vectorised call (no per-row
``torch.Generator``). The mixer is splitmix64's finaliser (Steele et al. 2014), which passes
BigCrush on sequential counters.

The engine draws a step's numbers on the host (:func:`step_draws`, :func:`host_uniforms`:
numpy's uint64 arithmetic wraps and shifts logically) and sends them with one copy: the keys
and steps are host values, and on the device the mixer was about twenty tensor operations
(twenty kernel launches on a GPU) a stream a step. :func:`uniforms` and :func:`step_uniforms`
are the same mixer over device tensors (int64 arithmetic wraps in torch on CPU and GPU): the
reference the host's draws are tested against bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import numpy as np
import torch

__all__ = [
    "DRAFT_STREAM",
    "VERIFY_STREAM",
    "counter",
    "host_uniforms",
    "step_draws",
    "step_uniforms",
    "stream_key",
    "uniforms",
]

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


_Index = TypeVar("_Index", torch.Tensor, np.ndarray)


def counter(step: _Index, branch: _Index | int, position: _Index | int) -> _Index:
    """Counter of the draw for (step, branch, position); broadcasts over tensors or arrays."""
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


_U_M1, _U_M2, _U_GOLDEN = np.uint64(_M1), np.uint64(_M2), np.uint64(_GOLDEN)


def host_uniforms(keys: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """:func:`uniforms` in numpy: (B,) int64 keys and (B, ...) counters -> float64, the same
    bits (uint64 arithmetic wraps as int64's does; its shifts are logical)."""
    z = keys.astype(np.int64).view(np.uint64).reshape(keys.shape + (1,) * (counters.ndim - 1))
    z = z + counters.astype(np.uint64) * _U_GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _U_M1
    z = (z ^ (z >> np.uint64(27))) * _U_M2
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def step_draws(
    keys: Sequence[int], steps: Sequence[int], num_branches: int, num_positions: int
) -> np.ndarray:
    """One step's draws of every row on the host: (B, branches, positions) float64, as
    :func:`step_uniforms` gives them (none to make: no work, e.g. a step nobody drafts in)."""
    if num_branches == 0 or num_positions == 0:
        return np.zeros((len(keys), num_branches, num_positions))
    counters = counter(
        np.asarray(steps, dtype=np.int64).reshape(-1, 1, 1),
        np.arange(num_branches, dtype=np.int64).reshape(1, -1, 1),
        np.arange(num_positions, dtype=np.int64).reshape(1, 1, -1),
    )
    return host_uniforms(np.asarray(keys, dtype=np.int64), counters)
