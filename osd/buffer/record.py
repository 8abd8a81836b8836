"""The log record: what a replica remembers about one finished request, for the trainer.

One record per finished request carries everything the trainer needs to distil the draft without
ever running the target (docs/design.md, "Record"): ids of the route and adapter, the sampling
parameters, all token ids, per-step drafted and accepted counts, the draft's probability of every
drafted token, and the target's top-m distribution (temperature 1) at every generated position.
Records carry no text: request id, domain and adapter name are short printable identifiers.

Pure (numpy and the standard library only). The binary format lives in `osd.buffer.wire`;
`Record.pack` and `Record.unpack` are the way in and out.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from osd.buffer.wire import (
    METHODS,
    SCHEMA_VERSION,
    Method,
    RecordVersionError,
    pack_fields,
    unpack_fields,
)
from osd.decode.methods import BASE_DRAFT_NAME, PROPOSERS

if TYPE_CHECKING:  # the decode core's output, read by attribute (no torch import here)
    from osd.decode.generation import GenerationLog

__all__ = ["MAX_ID_BYTES", "METHODS", "SCHEMA_VERSION", "Method", "Record", "RecordVersionError"]

MAX_ID_BYTES = 128


_INT64 = np.iinfo(np.int64)


def _check_id(name: str, value: Any, *, allow_empty: bool) -> None:
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a str, got {type(value).__name__}: {value!r:.80}")
    if not value and not allow_empty:
        raise ValueError(f"{name} must not be empty")
    if len(value.encode("utf-8")) > MAX_ID_BYTES or not value.isprintable():
        raise ValueError(
            f"{name} must be a printable identifier of at most {MAX_ID_BYTES} utf-8 bytes "
            f"(records carry no text), got {value!r:.80}"
        )


def _check_int(name: str, value: Any, low: int, high: int = int(_INT64.max)) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"{name} must be an int, got {type(value).__name__}: {value!r:.80}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")


def _check_float(name: str, value: Any, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float | np.floating):
        raise ValueError(f"{name} must be a float, got {type(value).__name__}: {value!r:.80}")
    if not (math.isfinite(value) and low <= value <= high):
        raise ValueError(f"{name} must be finite and in [{low}, {high}], got {value}")


def _as_ints(name: str, value: Any, dtype: type[np.integer], ndim: int) -> npt.NDArray[Any]:
    """Copies `value` into a read-only array of `dtype`, refusing negatives and overflow."""
    arr = np.asarray(value)
    if arr.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    info = np.iinfo(dtype)
    if arr.size and (arr.min() < 0 or arr.max() > info.max):
        raise ValueError(
            f"{name} values must be in [0, {info.max}], got min {arr.min()} max {arr.max()}"
        )
    out = np.array(arr, dtype=dtype, copy=True, order="C")
    out.setflags(write=False)
    return out


def _as_probs(name: str, value: Any, ndim: int) -> npt.NDArray[np.float16]:
    """Copies `value` into a read-only float16 array, refusing values outside [0, 1]."""
    arr = np.asarray(value)
    if arr.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {arr.shape}")
    if arr.size and arr.dtype.kind != "f":
        raise ValueError(f"{name} must hold floats, got dtype {arr.dtype}")
    out = np.array(arr, dtype=np.float16, copy=True, order="C")
    if out.size and not (np.all(out >= 0) and np.all(out <= 1)):
        bad = out[~((out >= 0) & (out <= 1))][0]
        raise ValueError(f"{name} must be probabilities in [0, 1], got {bad}")
    out.setflags(write=False)
    return out


def _check_consistent(
    prompt_len: int,
    *,
    token_ids: npt.NDArray[np.int32],
    num_drafted: npt.NDArray[np.int16],
    num_accepted: npt.NDArray[np.int16],
    draft_token_probs: npt.NDArray[np.float16],
    target_top_ids: npt.NDArray[np.int32],
    target_top_probs: npt.NDArray[np.float16],
) -> None:
    """Checks that the arrays of one record agree with each other and with prompt_len."""
    if prompt_len > len(token_ids):
        raise ValueError(f"prompt_len {prompt_len} exceeds len(token_ids) {len(token_ids)}")
    if num_accepted.shape != num_drafted.shape:
        raise ValueError(
            f"num_accepted shape {num_accepted.shape} != num_drafted shape {num_drafted.shape}"
        )
    if np.any(num_accepted > num_drafted):
        step = int(np.argmax(num_accepted > num_drafted))
        raise ValueError(
            f"num_accepted[{step}] = {num_accepted[step]} exceeds num_drafted[{step}] = "
            f"{num_drafted[step]}"
        )
    num_draft_tokens = int(num_drafted.sum(dtype=np.int64))
    if len(draft_token_probs) != num_draft_tokens:
        raise ValueError(
            f"draft_token_probs has length {len(draft_token_probs)}, "
            f"expected sum(num_drafted) = {num_draft_tokens}"
        )
    num_generated = len(token_ids) - prompt_len
    if target_top_ids.shape[0] != num_generated or target_top_probs.shape != target_top_ids.shape:
        raise ValueError(
            f"target_top_ids {target_top_ids.shape} and target_top_probs "
            f"{target_top_probs.shape} must both have shape (num_generated={num_generated}, m)"
        )


@dataclass(frozen=True, eq=False)
class Record:
    """One finished request, as the trainer sees it. Arrays are copied and made read-only.

    Shapes use T = len(token_ids), G = T - prompt_len (generated positions), S = number of
    verification steps, D = sum(num_drafted) and m = the number of logged target candidates.

    Attributes:
        request_id: short identifier of the request (no text).
        created_at: unix seconds when the request finished.
        domain: route key the router used; empty when none.
        adapter_name: draft adapter that proposed the tokens.
        adapter_version: version of that adapter.
        method: verification method, "token", "block" or "spectr".
        temperature: sampling temperature (0 means greedy).
        top_p: nucleus mass in (0, 1].
        top_k: top-k cut-off; 0 or -1 means no cut-off.
        max_tokens: generation budget of the request.
        seed: sampling seed, or None.
        num_spec_tokens: k, tokens drafted per step (per draft).
        num_drafts: K, drafts per step (1 except for spectr).
        prompt_len: number of prompt tokens at the front of token_ids.
        token_ids: (T,) int32, prompt then generated tokens.
        num_drafted: (S,) int16, tokens drafted at each step.
        num_accepted: (S,) int16, drafted tokens accepted at each step.
        draft_token_probs: (D,) float16, draft probability of each drafted token, step by step.
        target_top_ids: (G, m) int32, target's top-m token ids at each generated position.
        target_top_probs: (G, m) float16, their probabilities at temperature 1.
    """

    request_id: str
    created_at: float
    domain: str
    adapter_name: str
    adapter_version: int
    method: Method
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    seed: int | None
    num_spec_tokens: int
    num_drafts: int
    prompt_len: int
    token_ids: npt.NDArray[np.int32] = field(repr=False)
    num_drafted: npt.NDArray[np.int16] = field(repr=False)
    num_accepted: npt.NDArray[np.int16] = field(repr=False)
    draft_token_probs: npt.NDArray[np.float16] = field(repr=False)
    target_top_ids: npt.NDArray[np.int32] = field(repr=False)
    target_top_probs: npt.NDArray[np.float16] = field(repr=False)
    # (S,) uint8: who drafted each step, its index in PROPOSERS; None: the draft model throughout.
    step_proposers: npt.NDArray[np.uint8] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._check_scalars()
        self._set_arrays()

    def _check_scalars(self) -> None:
        _check_id("request_id", self.request_id, allow_empty=False)
        _check_id("domain", self.domain, allow_empty=True)
        _check_id("adapter_name", self.adapter_name, allow_empty=False)
        _check_float("created_at", self.created_at, 0.0, math.inf)
        _check_int("adapter_version", self.adapter_version, 0)
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        _check_float("temperature", self.temperature, 0.0, math.inf)
        _check_float("top_p", self.top_p, 0.0, 1.0)
        if self.top_p == 0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, -1, 2**31 - 1)
        _check_int("max_tokens", self.max_tokens, 1, 2**31 - 1)
        if self.seed is not None:
            _check_int("seed", self.seed, int(_INT64.min))
        _check_int("num_spec_tokens", self.num_spec_tokens, 1, 2**31 - 1)
        _check_int("num_drafts", self.num_drafts, 1, 2**31 - 1)
        _check_int("prompt_len", self.prompt_len, 0, 2**31 - 1)

    def _set_arrays(self) -> None:
        arrays = {
            "token_ids": _as_ints("token_ids", self.token_ids, np.int32, 1),
            "num_drafted": _as_ints("num_drafted", self.num_drafted, np.int16, 1),
            "num_accepted": _as_ints("num_accepted", self.num_accepted, np.int16, 1),
            "draft_token_probs": _as_probs("draft_token_probs", self.draft_token_probs, 1),
            "target_top_ids": _as_ints("target_top_ids", self.target_top_ids, np.int32, 2),
            "target_top_probs": _as_probs("target_top_probs", self.target_top_probs, 2),
        }
        _check_consistent(self.prompt_len, **arrays)
        for name, arr in arrays.items():
            object.__setattr__(self, name, arr)
        steps = len(arrays["num_drafted"])
        if self.step_proposers is None:
            codes = np.zeros(steps, dtype=np.uint8)
        else:
            codes = _as_ints("step_proposers", self.step_proposers, np.uint8, 1)
        if codes.shape != (steps,) or np.any(codes >= len(PROPOSERS)):
            raise ValueError(
                f"step_proposers must hold one code below {len(PROPOSERS)} per step ({steps})"
            )
        object.__setattr__(self, "step_proposers", codes)

    @property
    def num_generated(self) -> int:
        """G, the number of generated tokens."""
        return len(self.token_ids) - self.prompt_len

    @property
    def num_steps(self) -> int:
        """S, the number of verification steps."""
        return len(self.num_drafted)

    @property
    def top_m(self) -> int:
        """m, the number of target candidates logged per generated position."""
        return int(self.target_top_ids.shape[1])

    @property
    def prompt_ids(self) -> npt.NDArray[np.int32]:
        """(prompt_len,) int32 prompt token ids."""
        return self.token_ids[: self.prompt_len]

    @property
    def generated_ids(self) -> npt.NDArray[np.int32]:
        """(G,) int32 generated token ids."""
        return self.token_ids[self.prompt_len :]

    @property
    def model_steps(self) -> npt.NDArray[np.bool_]:
        """(S,) bool: the steps the draft model drafted (not a model-free proposer)."""
        assert self.step_proposers is not None  # set by __post_init__
        return self.step_proposers == PROPOSERS.index("draft")

    @property
    def cu_num_drafted(self) -> npt.NDArray[np.int64]:
        """(S + 1,) offsets: step s drafted draft_token_probs[cu[s]:cu[s + 1]]."""
        return np.concatenate([[0], np.cumsum(self.num_drafted, dtype=np.int64)])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Record):
            return NotImplemented
        return self.pack() == other.pack()

    __hash__ = None  # type: ignore[assignment]

    def pack(self) -> bytes:
        """Packs the record into versioned binary (see `osd.buffer.wire` for the layout)."""
        return pack_fields({f.name: getattr(self, f.name) for f in fields(self)})

    @classmethod
    def from_generation(
        cls,
        log: GenerationLog,
        *,
        request_id: str,
        domain: str = "",
        adapter_name: str | None = None,
        adapter_version: int = 0,
        created_at: float | None = None,
    ) -> Record:
        """The record of a finished generation's log (what a replica stores; no text).

        ``adapter_name`` defaults to the adapter the request used (``base`` for none). The
        settings come from the request's one options value (``log.request``), unchanged.
        """
        request, params = log.request, log.request.params
        return cls(
            request_id=request_id,
            created_at=time.time() if created_at is None else created_at,
            domain=domain,
            adapter_name=adapter_name or request.adapter or BASE_DRAFT_NAME,
            adapter_version=adapter_version,
            method=request.method,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            max_tokens=request.max_new_tokens,
            seed=request.seed,
            num_spec_tokens=request.num_spec_tokens,
            num_drafts=request.num_drafts,
            prompt_len=log.prompt_len,
            token_ids=log.token_ids.numpy(),
            num_drafted=log.num_drafted.numpy(),
            num_accepted=log.num_accepted.numpy(),
            draft_token_probs=log.draft_token_probs.numpy(),
            target_top_ids=log.target_top_ids.numpy(),
            target_top_probs=log.target_top_probs.numpy(),
            step_proposers=np.array(
                [PROPOSERS.index(name) for name in log.step_proposers], dtype=np.uint8
            ),
        )

    @classmethod
    def unpack(cls, data: bytes | bytearray | memoryview) -> Record:
        """Decodes bytes made by `pack`; the result is validated like any new record.

        Raises:
            RecordVersionError: the bytes are a record of another schema version.
            ValueError: bad magic, truncated or garbled bytes, or invalid fields.
        """
        return cls(**unpack_fields(data))

    @classmethod
    def make_dummy(
        cls,
        *,
        num_generated: int = 16,
        m: int = 8,
        prompt_len: int = 8,
        num_spec_tokens: int = 4,
        num_drafts: int = 1,
        method: Method = "block",
        vocab_size: int = 1000,
        seed: int = 0,
        request_id: str | None = None,
        domain: str = "",
        adapter_name: str = "general",
        adapter_version: int = 1,
        created_at: float = 1_700_000_000.0,
    ) -> Record:
        """Builds a consistent, random record for tests and benchmarks; same seed, same record.

        Steps draft num_spec_tokens * num_drafts tokens and accept a random number of them; each
        step emits the accepted tokens plus one. Target rows are a random descending top-m
        distribution, and each generated token is sampled from its row.
        """
        if m > vocab_size:
            raise ValueError(f"m {m} must not exceed vocab_size {vocab_size}")
        rng = np.random.default_rng(seed)
        drafted, accepted = _dummy_steps(rng, num_generated, num_spec_tokens, num_drafts)
        top_ids, top_probs, generated = _dummy_target(rng, num_generated, m, vocab_size)
        prompt = rng.integers(0, vocab_size, size=prompt_len)
        return cls(
            request_id=request_id if request_id is not None else f"req-{seed}",
            created_at=created_at,
            domain=domain,
            adapter_name=adapter_name,
            adapter_version=adapter_version,
            method=method,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_tokens=max(num_generated, 1),
            seed=seed,
            num_spec_tokens=num_spec_tokens,
            num_drafts=num_drafts,
            prompt_len=prompt_len,
            token_ids=np.concatenate([prompt, generated]).astype(np.int32),
            num_drafted=drafted,
            num_accepted=accepted,
            draft_token_probs=rng.random(int(drafted.sum())).astype(np.float16),
            target_top_ids=top_ids,
            target_top_probs=top_probs,
        )


def _dummy_steps(
    rng: np.random.Generator, num_generated: int, num_spec_tokens: int, num_drafts: int
) -> tuple[npt.NDArray[np.int16], npt.NDArray[np.int16]]:
    """(S,) drafted and accepted counts whose steps emit exactly num_generated tokens."""
    drafted: list[int] = []
    accepted: list[int] = []
    emitted = 0
    while emitted < num_generated:
        kept = min(int(rng.integers(0, num_spec_tokens + 1)), num_generated - emitted - 1)
        drafted.append(num_spec_tokens * num_drafts)
        accepted.append(kept)
        emitted += kept + 1  # the accepted tokens, then a recovered or bonus token
    return np.asarray(drafted, dtype=np.int16), np.asarray(accepted, dtype=np.int16)


def _dummy_target(
    rng: np.random.Generator, num_generated: int, m: int, vocab_size: int
) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.float16], npt.NDArray[np.int32]]:
    """Random top-m rows (ids, descending probs) and a token sampled from each row."""
    top_ids = np.zeros((num_generated, m), dtype=np.int32)  # (G, m)
    for row in top_ids:
        row[:] = rng.choice(vocab_size, size=m, replace=False)
    weights = np.sort(rng.dirichlet(np.full(m + 1, 0.3), size=num_generated), axis=1)[:, ::-1]
    top_probs = weights[:, :m]  # (G, m); the smallest weight is the unlogged tail
    cdf = np.cumsum(top_probs, axis=1) / top_probs.sum(axis=1, keepdims=True)  # (G, m)
    picks = np.minimum((rng.random((num_generated, 1)) >= cdf).sum(axis=1), m - 1)  # (G,)
    generated = top_ids[np.arange(num_generated), picks]  # (G,)
    return top_ids, top_probs.astype(np.float16), generated
