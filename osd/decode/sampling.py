"""Sampling: logits to the distribution a token is actually drawn from, and drawing from it.

The draft's ``q`` and the target's ``p`` both come from :func:`rows_to_probs`, so every
verifier sees exactly the post-processing distribution that each token was sampled from;
getting that wrong breaks losslessness silently (docs/algorithms.md, "Post-processing keeps
verification exact"). The processing, in order:
a structured-output grammar's mask (disallowed tokens get no mass, :mod:`osd.decode.grammar`);
``logit_bias`` added; ``repetition_penalty`` on tokens of the prompt or generated so far (a
positive logit divided by it, a negative one multiplied, as vLLM and HF do);
``frequency_penalty`` times each generated token's count and ``presence_penalty`` once per
generated token subtracted (OpenAI's definition); temperature; top-k; ``min_p`` (tokens below
``min_p`` times the most likely one's probability dropped); top-p. Everything after the bias
depends on the prefix only, so applying it to the draft's and the target's logits with the same
prefix keeps verification exact: within a drafted block, position i counts the drafted tokens
before it (:func:`block_history`). Temperature 0 is greedy: the distribution is one-hot on the
argmax of the processed logits, which makes every verifier reduce to its greedy rule without a
separate code path.

Random numbers are never drawn here: callers pass uniforms, so the functions are pure and can be
tested with hand-made tables.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from osd.decode.prefix_history import History
from osd.devices import to_device
from osd.errors import ParamError

__all__ = [
    "GREEDY_BELOW",
    "RowSampling",
    "SamplingParams",
    "logits_to_probs",
    "rows_to_greedy_ids",
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
        min_p: tokens whose probability is below ``min_p`` times the most likely token's are
            dropped, in [0, 1]; 0 keeps everything.
        presence_penalty: subtracted from the logit of every token generated so far, in
            [-2, 2] (OpenAI's range).
        frequency_penalty: subtracted once per time a token was generated so far, in [-2, 2].
        repetition_penalty: > 0; tokens of the prompt or generated so far have a positive
            logit divided by it and a negative one multiplied (1 changes nothing).
        logit_bias: (token id, bias) pairs added to those tokens' logits, bias in [-100, 100];
            a mapping is accepted and stored as sorted pairs.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:  # also rejects NaN
            raise ParamError("temperature", f"temperature must be >= 0, got {self.temperature!r}")
        if self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)
        if not 0.0 < self.top_p <= 1.0:
            raise ParamError("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise ParamError("top_k", f"top_k must be >= 0 (0 disables it), got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ParamError("min_p", f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ParamError(name, f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if not 0.0 < self.repetition_penalty < float("inf"):
            raise ParamError(
                "repetition_penalty",
                f"repetition_penalty must be > 0, got {self.repetition_penalty!r}",
            )
        bias = self.logit_bias
        pairs = sorted(bias.items() if isinstance(bias, Mapping) else bias)
        for token, value in pairs:
            if not isinstance(token, int) or token < 0:
                raise ParamError(
                    "logit_bias", f"logit_bias keys must be token ids >= 0, got {token!r}"
                )
            if not -100.0 <= value <= 100.0:
                raise ParamError(
                    "logit_bias", f"logit_bias values must be in [-100, 100], got {value!r}"
                )
        object.__setattr__(self, "logit_bias", tuple((t, float(v)) for t, v in pairs))

    @property
    def is_greedy(self) -> bool:
        """Whether decoding is deterministic argmax."""
        return self.temperature == 0.0

    @property
    def uses_history(self) -> bool:
        """Whether the distribution depends on the tokens before it (a penalty is on)."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )


def logits_to_probs(
    logits: torch.Tensor, params: SamplingParams, history: History | None = None
) -> torch.Tensor:
    """Turns logits into the distribution tokens are sampled from.

    Args:
        logits: (..., V) raw model logits, any float dtype.
        params: the processing to apply (module docstring).
        history: the prefix the penalties see, broadcastable to ``logits``; needed when
            ``params.uses_history``.

    Returns:
        (..., V) float32 (or float64 if the logits are) probabilities summing to 1 over the
        last dimension; one-hot on the argmax when ``params.temperature == 0``.
    """
    one_row = RowSampling.of([params], logits.device, vocab_size=logits.shape[-1])
    if history is not None:
        history = History(history.counts.unsqueeze(0), history.seen.unsqueeze(0))
    return rows_to_probs(logits.unsqueeze(0), one_row, history).squeeze(0)


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
    min_p: torch.Tensor  # (B,) float
    presence: torch.Tensor  # (B,) float
    frequency: torch.Tensor  # (B,) float
    repetition: torch.Tensor  # (B,) float
    bias: torch.Tensor | None = None  # (B, V) float when some row has a logit_bias
    # Known on the host, so no step asks the device whether a filter is needed (no sync);
    # True when some row may need it.
    any_greedy: bool = True
    any_top_k: bool = True
    any_top_p: bool = True
    all_greedy: bool = False
    any_min_p: bool = True
    any_history: bool = True  # some row has a penalty: the caller passes a History

    @staticmethod
    def of(
        params: list[SamplingParams], device: torch.device | str, vocab_size: int = 0
    ) -> RowSampling:
        """The rows' parameters on ``device``; ``vocab_size`` is needed when a row has a
        ``logit_bias`` (token ids at or above it are an error)."""
        values = to_device(
            torch.tensor(
                [
                    [
                        p.temperature,
                        p.top_p,
                        p.top_k,
                        p.min_p,
                        p.presence_penalty,
                        p.frequency_penalty,
                        p.repetition_penalty,
                    ]
                    for p in params
                ]
            ),
            device,
        )
        bias = None
        if any(p.logit_bias for p in params):
            bias = _bias_table(params, vocab_size, device)
        return RowSampling(
            temperature=values[:, 0],
            top_p=values[:, 1],
            top_k=values[:, 2].long(),
            min_p=values[:, 3],
            presence=values[:, 4],
            frequency=values[:, 5],
            repetition=values[:, 6],
            bias=bias,
            any_greedy=any(p.is_greedy for p in params),
            any_top_k=any(p.top_k > 0 for p in params),
            any_top_p=any(p.top_p < 1.0 for p in params),
            all_greedy=all(p.is_greedy for p in params),
            any_min_p=any(p.min_p > 0 for p in params),
            any_history=any(p.uses_history for p in params),
        )

    def select(self, index: torch.Tensor) -> RowSampling:
        """The rows ``index`` (a (B',) int64 tensor), e.g. one row per draft branch."""
        return dataclasses.replace(
            self,
            temperature=self.temperature[index],
            top_p=self.top_p[index],
            top_k=self.top_k[index],
            min_p=self.min_p[index],
            presence=self.presence[index],
            frequency=self.frequency[index],
            repetition=self.repetition[index],
            bias=None if self.bias is None else self.bias[index],
        )


def _bias_table(
    params: list[SamplingParams], vocab_size: int, device: torch.device | str
) -> torch.Tensor:
    rows, tokens, values = [], [], []
    for row, p in enumerate(params):
        for token, value in p.logit_bias:
            if token >= vocab_size:
                raise ValueError(
                    f"logit_bias names token {token}; the vocabulary has {vocab_size} tokens"
                )
            rows.append(row)
            tokens.append(token)
            values.append(value)
    # Made on the device: only the few (row, token, bias) entries cross from the host.
    table = torch.zeros(len(params), vocab_size, device=device)
    at = to_device(torch.tensor([rows, tokens], dtype=torch.int64), device)
    table[at[0], at[1]] = to_device(torch.tensor(values), device)
    return table


def _process_logits(
    logits: torch.Tensor,
    rows: RowSampling,
    history: History | None,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """The grammar mask, the logit bias and the penalties (before temperature), for every row
    at once, in float32 (float64 for float64 logits)."""
    logits = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
    shape = (-1,) + (1,) * (logits.dim() - 1)
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    if rows.bias is not None:
        bias = rows.bias.to(logits.dtype)
        logits = logits + bias.view(bias.shape[0], *(1,) * (logits.dim() - 2), bias.shape[-1])
    if rows.any_history:
        if history is None:
            raise ValueError("a row has a penalty: rows_to_probs needs the rows' History")
        repetition = rows.repetition.to(logits.dtype).view(shape)
        penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(history.seen, penalised, logits)
        counts = history.counts.to(logits.dtype)
        logits = logits - rows.frequency.to(logits.dtype).view(shape) * counts
        logits = logits - rows.presence.to(logits.dtype).view(shape) * (counts > 0)
    return logits


def rows_to_probs(
    logits: torch.Tensor,
    rows: RowSampling,
    history: History | None = None,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logits to the distribution tokens are sampled from, with each row's own processing
    (module docstring; top-k is a sort and kth value per row); :func:`logits_to_probs` is its
    one-row case.

    Args:
        logits: (B, ..., V) raw logits; row b uses the parameters at index b.
        rows: the rows' parameters.
        history: each row's prefix as the penalties see it, broadcastable to ``logits`` (for a
            drafted block: :func:`block_history`); needed when ``rows.any_history``.
        allowed: bool, broadcastable to ``logits``: the tokens a row's grammar allows at each
            position (:mod:`osd.decode.grammar`); None: every token. Each row must allow at least
            one.

    Returns:
        (B, ..., V) float32 (float64 for float64 logits) probabilities.
    """
    logits = _process_logits(logits, rows, history, allowed)
    dtype = logits.dtype
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
    if rows.any_min_p:
        min_p = rows.min_p.to(dtype).view(shape)
        floor = min_p * probs.amax(dim=-1, keepdim=True)
        kept = torch.where(probs >= floor, probs, 0.0)  # the most likely token always stays
        probs = kept / kept.sum(dim=-1, keepdim=True)
    top_p = rows.top_p.to(dtype).view(shape)
    if rows.any_top_p:
        probs = torch.where(top_p < 1.0, _keep_top_p(probs, top_p), probs)
    if rows.any_greedy:
        one_hot = torch.zeros_like(logits).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy, one_hot, probs)
    return probs


def rows_to_greedy_ids(
    logits: torch.Tensor,
    rows: RowSampling,
    history: History | None = None,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """The tokens rows that are all greedy take: (B, ..., V) logits -> (B, ...) ids, the argmax
    of the processed logits, where :func:`rows_to_probs` puts all its mass (arguments as
    there), without building the (B, ..., V) distribution."""
    assert rows.all_greedy, "rows_to_greedy_ids is for greedy rows only"
    return _process_logits(logits, rows, history, allowed).argmax(dim=-1)


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
    total = cdf[..., -1:].contiguous()  # (..., 1)
    targets = uniforms.to(cdf.dtype).unsqueeze(-1) * total  # (..., 1)
    ids = torch.searchsorted(cdf.contiguous(), targets.contiguous(), right=True).squeeze(-1)
    ids = ids.clamp_(max=probs.shape[-1] - 1)
    # Rounding can land past the last token with mass (a draw at the cdf's top); it then takes
    # the first token at which the cdf reaches its total: the cdf rises there, so that token
    # has mass (always computed: asking the device whether it is needed would cost a host
    # sync; a search of one value a row, where a (..., V) pass over ``probs > 0`` cost half
    # of a 16-row draw).
    chosen_mass = probs.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    top = torch.searchsorted(cdf, total, right=False).squeeze(-1)
    return torch.where(chosen_mass > 0, ids, top)
