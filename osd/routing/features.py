"""What the content router sees of a prompt: hashed token and token-pair counts.

A prompt's token ids (the same the engine prefills, so nothing is tokenized twice) become one
fixed-size vector: each token and each pair of adjacent tokens adds to one of `dim` buckets
(a multiplicative hash, the same in every process), counts are damped (`log1p`) and the vector is
scaled to unit length. Only the last `MAX_PROMPT_TOKENS` tokens count, so a long prompt costs no
more than a short one. Pure: numpy only.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

__all__ = ["DEFAULT_DIM", "MAX_PROMPT_TOKENS", "prompt_features", "stack_features"]

DEFAULT_DIM = 1024
MAX_PROMPT_TOKENS = 1024
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: spreads consecutive ids
_PAIR = np.uint64(0x100000001B3)


def _buckets(keys: npt.NDArray[np.uint64], dim: int) -> npt.NDArray[np.int64]:
    mixed = keys * _GOLDEN  # wraps modulo 2**64, as a hash should
    return ((mixed >> np.uint64(32)) % np.uint64(dim)).astype(np.int64)


def prompt_features(
    token_ids: Sequence[int] | npt.NDArray[np.integer], dim: int = DEFAULT_DIM
) -> npt.NDArray[np.float32]:
    """(dim,) float32 unit vector of a prompt's token ids (all zeros for an empty prompt)."""
    if dim < 2:
        raise ValueError(f"dim must be >= 2, got {dim}")
    ids = np.asarray(token_ids, dtype=np.int64)[-MAX_PROMPT_TOKENS:]
    if ids.ndim != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {ids.shape}")
    counts = np.zeros(dim, dtype=np.float32)
    if ids.size == 0:
        return counts
    keys = ids.astype(np.uint64)
    with np.errstate(over="ignore"):
        pairs = keys[:-1] * _PAIR + keys[1:] + np.uint64(1)
        np.add.at(counts, _buckets(keys, dim), 1.0)
        np.add.at(counts, _buckets(pairs, dim), 1.0)
    counts = np.log1p(counts)
    return counts / np.float32(np.linalg.norm(counts))


def stack_features(
    prompts: Sequence[Sequence[int] | npt.NDArray[np.integer]], dim: int = DEFAULT_DIM
) -> npt.NDArray[np.float32]:
    """(N, dim) features of N prompts."""
    if not prompts:
        return np.zeros((0, dim), dtype=np.float32)
    return np.stack([prompt_features(p, dim) for p in prompts])
