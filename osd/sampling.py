"""Sampling: logits to the distribution a token is actually drawn from, and drawing from it.

The draft's ``q`` and the target's ``p`` both come from :func:`logits_to_probs`, so every
verifier sees exactly the post-processing distribution (temperature, top-k, top-p) that each
token was sampled from; getting that wrong breaks losslessness silently (ALGORITHMS.md).
Temperature 0 is greedy: the distribution is one-hot on the argmax, which makes every verifier
reduce to its greedy rule without a separate code path.

Random numbers are never drawn here: callers pass uniforms, so the functions are pure and can be
tested with hand-made tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from osd.devices import to_device

__all__ = [
    "GREEDY_BELOW",
    "RowSampling",
    "SamplingParams",
    "logits_to_probs",
    "rows_to_probs",
    "sample_from_probs",
]


GREEDY_BELOW = 1e-5  # temperatures under this decode greedily (vLLM draws the same line)


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen from a model's logits.

    Attributes:
        temperature: 0 means greedy (argmax); otherwise logits are divided by it. Must be >= 0;
            below ``GREEDY_BELOW`` it is greedy too (set to 0: dividing logits by a subnormal
            temperature overflows to NaN, and this close to 0 the distribution is the argmax).
        top_p: nucleus mass kept, in (0, 1]; 1 keeps everything.
        top_k: number of most likely tokens kept; 0 keeps everything.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k!r}")

    @property
    def is_greedy(self) -> bool:
        """Whether decoding is deterministic argmax."""
        return self.temperature == 0.0


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turns logits into the distribution tokens are sampled from.

    Args:
        logits: (..., V) raw model logits, any float dtype.
        params: temperature, top-k and top-p to apply, in that order.

    Returns:
        (..., V) float32 (or float64 if the logits are) probabilities summing to 1 over the
        last dimension; one-hot on the argmax when ``params.temperature == 0``.
    """
    one_row = RowSampling.of([params], logits.device)
    return rows_to_probs(logits.unsqueeze(0), one_row).squeeze(0)


@dataclass(frozen=True)
class RowSampling:
    """Sampling parameters of every row of a batch, as tensors on the batch's device.

    Attributes:
        temperature: (B,) float; 0 is greedy.
        top_p: (B,) float in (0, 1].
        top_k: (B,) int64; 0 keeps everything.
    """

    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    # Known on the host, so no step asks the device whether a filter is needed (no sync);
    # True when some row may need it.
    any_greedy: bool = True
    any_top_k: bool = True
    any_top_p: bool = True
    all_greedy: bool = False

    @staticmethod
    def of(params: list[SamplingParams], device: torch.device | str) -> RowSampling:
        values = to_device(
            torch.tensor([[p.temperature, p.top_p, p.top_k] for p in params]), device
        )
        return RowSampling(
            temperature=values[:, 0],
            top_p=values[:, 1],
            top_k=values[:, 2].long(),
            any_greedy=any(p.is_greedy for p in params),
            any_top_k=any(p.top_k > 0 for p in params),
            any_top_p=any(p.top_p < 1.0 for p in params),
            all_greedy=all(p.is_greedy for p in params),
        )

    def select(self, index: torch.Tensor) -> RowSampling:
        """The rows ``index`` (a (B',) int64 tensor), e.g. one row per draft branch."""
        return RowSampling(
            self.temperature[index],
            self.top_p[index],
            self.top_k[index],
            self.any_greedy,
            self.any_top_k,
            self.any_top_p,
            self.all_greedy,
        )


def rows_to_probs(logits: torch.Tensor, rows: RowSampling) -> torch.Tensor:
    """Logits to the distribution tokens are sampled from, with each row's own temperature,
    top-k (a sort, kth value per row) and top-p; :func:`logits_to_probs` is its one-row case.

    Args:
        logits: (B, ..., V) raw logits; row b uses the parameters at index b.
        rows: the rows' parameters.

    Returns:
        (B, ..., V) float32 (float64 for float64 logits) probabilities.
    """
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logits = logits.to(dtype)
    if rows.all_greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    shape = (-1,) + (1,) * (logits.dim() - 1)
    greedy = (rows.temperature == 0).view(shape)
    temperature = torch.where(rows.temperature > 0, rows.temperature, 1.0).to(dtype)
    scaled = logits / temperature.view(shape)
    if rows.any_top_k:
        vocab_size = logits.shape[-1]
        top_k = rows.top_k.view(shape)
        filter_k = (top_k > 0) & (top_k < vocab_size)
        sorted_logits = torch.sort(scaled, dim=-1, descending=True).values
        index = (top_k.clamp(1, vocab_size) - 1).expand(*scaled.shape[:-1], 1)
        kth_largest = sorted_logits.gather(-1, index)
        scaled = torch.where(filter_k & (scaled < kth_largest), float("-inf"), scaled)
    probs = torch.softmax(scaled, dim=-1)
    top_p = rows.top_p.to(dtype).view(shape)
    if rows.any_top_p:
        probs = torch.where(top_p < 1.0, _keep_top_p(probs, top_p), probs)
    if rows.any_greedy:
        one_hot = torch.zeros_like(logits).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy, one_hot, probs)
    return probs


def _keep_top_p(probs: torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """Keeps the smallest set of most likely tokens whose mass reaches ``top_p``; renormalises."""
    sorted_probs, sorted_ids = torch.sort(probs, dim=-1, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # (..., V)
    # A token is kept if the mass strictly before it is below top_p; the first is always kept.
    keep_sorted = mass_before < top_p
    keep_sorted[..., 0] = True
    keep = torch.zeros_like(keep_sorted).scatter_(-1, sorted_ids, keep_sorted)
    kept = probs * keep
    return kept / kept.sum(dim=-1, keepdim=True)


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Draws one token per row by inverting the cumulative distribution.

    A token of zero probability is never returned, whatever the uniform.

    Args:
        probs: (..., V) non-negative weights (need not be normalised).
        uniforms: (...) draws from U[0, 1).

    Returns:
        (...) int64 token ids.
    """
    cdf = torch.cumsum(probs, dim=-1)  # (..., V)
    targets = (uniforms.to(cdf.dtype) * cdf[..., -1]).unsqueeze(-1)  # (..., 1)
    ids = torch.searchsorted(cdf.contiguous(), targets.contiguous(), right=True).squeeze(-1)
    ids = ids.clamp_(max=probs.shape[-1] - 1)
    # Rounding can land past the last token with mass; step back to the last nonzero one
    # (always computed: asking the device whether it is needed would cost a host sync).
    chosen_mass = probs.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    positions = torch.arange(probs.shape[-1], device=probs.device)
    last_nonzero = torch.where(probs > 0, positions, -1).amax(dim=-1)
    return torch.where(chosen_mass > 0, ids, last_nonzero)
