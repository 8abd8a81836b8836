"""Who drafts each row's tokens at a step: the proposers behind one seam.

A proposer, given a row and its budget k, offers drafted tokens with q per position. The draft
model (``draft``: LoRA adapters per row, :mod:`osd.decode.drafting`) samples its tokens and
gives its own q; the model-free proposers (``suffix`` and ``ngram``, :mod:`.lookup`) look their
tokens up in text already seen and give q one-hot, which the verifiers accept as they accept any
q (docs/algorithms.md, "Deterministic drafts"). For each row at each step the goodput controller
picks the proposer and k (:meth:`osd.decode.goodput.GoodputController.choose_proposer`); a step
in which no row uses the draft model runs no draft forward. :class:`Proposers` is the set an
engine holds: it plans a step (:meth:`Proposers.plan`), writes the looked-up drafts into the
step's draft tensors (:meth:`Proposers.fill`) and learns finished requests.

A new model-free proposer is one module with ``offer(row, limit)`` and ``learn(tokens, route)``
and one entry in :data:`LOOKUPS`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from osd.decode.goodput import GoodputController
from osd.decode.methods import PROPOSER_CHOICES, ProposerChoice
from osd.decode.proposers.lookup import LookupProposer, SuffixScope
from osd.decode.proposers.token_index import Continuation
from osd.decode.rows import Row
from osd.devices import to_device

__all__ = [
    "LOOKUPS",
    "LookupBackoff",
    "LookupSettings",
    "LookupYield",
    "PROPOSER_CHOICES",
    "ProposerChoice",
    "Proposers",
    "StepPlan",
    "SuffixScope",
]


@dataclass(frozen=True)
class LookupSettings:
    """Settings of the model-free proposers (config ``spec.suffix_*``, ``max_tokens``:
    ``spec.max_lookup_tokens``).

    ``max_tokens`` caps a looked-up draft under ``"auto"`` k, apart from the draft model's
    ``max_spec_tokens``: a lookup costs no draft forward, only its positions in the target's
    verify, which the goodput controller weighs per row and per batch. Up to 15 a row's
    verify positions stay in the compiled graphs' few-token path
    (:data:`osd.decode.compiled_forward.FEW_TOKENS`)."""

    budget: int = 500_000
    scope: SuffixScope = "global"
    max_tokens: int = 8


# The model-free proposers by name. ``suffix`` looks in the row's own tokens too, so it finds
# whatever ``ngram`` finds: ``auto`` consults ``suffix`` only (AUTO_LOOKUPS).
LOOKUPS: dict[str, Callable[[LookupSettings], LookupProposer]] = {
    "suffix": lambda s: LookupProposer("suffix", shared=True, budget=s.budget, scope=s.scope),
    "ngram": lambda s: LookupProposer("ngram", shared=False),
}
AUTO_LOOKUPS = ("suffix",)


@dataclass
class LookupBackoff:
    """How often an ``auto`` row looks its continuation up: at every step while lookups give
    it drafts; after each lookup that gave it none (nothing found, or nothing worth
    drafting), twice as seldom as before, down to one step in ``max_gap``. A lookup costs
    the decode thread tens of microseconds a row, and text the stores cannot continue (a new
    domain, sampled at a high temperature) would pay it at every step for nothing. Decided on
    past steps only, so exactness is untouched; a row's own new tokens are indexed at its next
    lookup, so a gap loses no text, only up to ``max_gap - 1`` steps of a match that appears.
    """

    max_gap: int = 8
    misses: int = 0  # lookups in a row that gave no draft
    next_step: int = 0  # the row's step at which it looks up again

    @staticmethod
    def of(row: Row, cold: bool = False) -> LookupBackoff:
        """The row's backoff; a new one for a row of a ``cold`` route (its recent lookups
        nearly never drafted: :class:`LookupYield`) starts as after four misses and backs
        off to one step in 32: on sampled text of a new domain every new row otherwise paid
        its first steps' lookups (11 in 64 tokens), 5 % of a served step at 16 rows (the
        lookups, and the target's weights they push out of the CPU's caches)."""
        found = row.scratch.get("lookup_backoff")
        if found is None:
            found = LookupBackoff(max_gap=32, misses=4) if cold else LookupBackoff()
            row.scratch["lookup_backoff"] = found
        return found

    def due(self, step: int) -> bool:
        return step >= self.next_step

    def update(self, drafted: bool, step: int) -> None:
        """After a lookup at ``step``: did it give the row a draft?"""
        self.misses = 0 if drafted else self.misses + 1
        gap = min(1 << max(self.misses - 1, 0), self.max_gap)  # 1, 1, 2, 4, 8, 8, ...
        self.next_step = step + gap


@dataclass
class LookupYield:
    """How often an ``auto`` row's lookups on one route gave it a draft, over recent lookups
    (each weighs ``keep`` of the one after it)."""

    keep: float = 0.995
    min_lookups: float = 50.0
    cold_share: float = 0.02
    lookups: float = 0.0
    drafted: float = 0.0

    def add(self, drafted: bool) -> None:
        self.lookups = self.lookups * self.keep + 1.0
        self.drafted = self.drafted * self.keep + float(drafted)

    @property
    def cold(self) -> bool:
        """Enough lookups seen, and under ``cold_share`` of them gave a draft."""
        return self.lookups >= self.min_lookups and self.drafted < self.cold_share * self.lookups


@dataclass
class StepPlan:
    """Who drafts what for each row of one step.

    Attributes:
        spec_k: tokens each row drafts (by any proposer; 0: none).
        model_k: k of the rows the draft model drafts (0 for the others).
        names: each row's proposer (``draft`` where it drafts nothing).
        lookups: rows whose drafts were looked up: their continuation, cut to their k.
        controlled: rows whose k the goodput controller chose (``auto``).
    """

    spec_k: list[int]
    model_k: list[int]
    names: list[str]
    lookups: dict[int, Continuation] = field(default_factory=dict)
    controlled: int = 0

    @property
    def model_runs(self) -> bool:
        return any(self.model_k)


class Proposers:
    """The draft model and the model-free proposers of one decoder.

    Args:
        settings: the model-free proposers' settings; None: the draft model alone.
    """

    def __init__(self, settings: LookupSettings | None = None) -> None:
        self.settings = settings
        self.lookups: dict[str, LookupProposer] = (
            {} if settings is None else {name: make(settings) for name, make in LOOKUPS.items()}
        )
        self.yields: dict[str, LookupYield] = {}  # by route

    def plan(
        self, rows: list[Row], controller: GoodputController | None, packs: bool = False
    ) -> StepPlan:
        """Chooses each row's proposer and k (see the module docstring); ``packs``: the
        target's forward computes only the positions rows have (no padding to the widest)."""
        batch = len(rows)
        plan = StepPlan([0] * batch, [0] * batch, ["draft"] * batch)
        looked_up: list[int] = []  # auto rows that looked up this step (LookupBackoff)
        look_up = controller is not None and controller.wants_lookups(batch)
        for b, row in enumerate(rows):
            request = row.request
            if request.method == "none" or row.prefill_left > 0:
                continue  # (a prompt riding in the step: osd.decode.loop) drafts nothing
            limit = min(request.num_spec_tokens, row.remaining - 1)
            plan.controlled += request.auto_spec
            choice = request.proposer
            # Grammars mask the draft's q as it drafts; SpecTr's K drafts come from the model.
            model_only = request.grammar is not None or request.num_slots > 1
            # "auto" is the controller's choice; with a fixed k (no controller) the draft
            # model drafts, so a seeded request's tokens do not depend on other traffic.
            choose = choice == "auto" and request.auto_spec and controller is not None
            if (
                limit <= 0
                or model_only
                or not self.lookups
                or not (choose or choice in self.lookups)
            ):
                plan.model_k[b] = plan.spec_k[b] = row.spec_tokens(controller, batch)
                continue
            # Under "auto" k a lookup has its own cap (LookupSettings.max_tokens); a fixed k
            # is the request's for every proposer.
            assert self.settings is not None
            free_limit = (
                min(self.settings.max_tokens, row.remaining - 1) if request.auto_spec else limit
            )
            if choice != "auto":  # one model-free proposer pinned
                self._take(plan, b, choice, self.lookups[choice].offer(row, free_limit))
                continue
            assert controller is not None
            offers: dict[str, Continuation | None] = {}
            # (LookupBackoff: rows of a cold route start backed off; no lookup where no offer
            # could be taken: GoodputController.lookups_could_pay)
            if look_up and controller.lookups_could_pay(
                batch, free_limit, request.route, AUTO_LOOKUPS
            ):
                cold = self._route_yield(request.route).cold
                if LookupBackoff.of(row, cold).due(row.step):
                    offers = {
                        name: self.lookups[name].offer(row, free_limit) for name in AUTO_LOOKUPS
                    }
                    looked_up.append(b)
            found = [(name, c.probs) for name, c in offers.items() if c is not None]
            name, k = controller.choose_proposer(
                row.stats_key, request.route, batch, limit, found, free_limit
            )
            if name == "draft":
                plan.model_k[b] = plan.spec_k[b] = k
            else:
                self._take(plan, b, name, offers[name], k)
        if controller is not None and len(plan.lookups) and not plan.model_runs and batch > 1:
            self._cap_width(plan, rows, controller, packs)
        for b in looked_up:
            LookupBackoff.of(rows[b]).update(b in plan.lookups, rows[b].step)
            self._route_yield(rows[b].request.route).add(b in plan.lookups)
        return plan

    def _route_yield(self, route: str) -> LookupYield:
        found = self.yields.get(route)
        if found is None:
            found = self.yields[route] = LookupYield()
        return found

    @staticmethod
    def _cap_width(
        plan: StepPlan, rows: list[Row], controller: GoodputController, packs: bool
    ) -> None:
        """Cuts the looked-up drafts to the width the whole batch gains most from
        (:meth:`GoodputController.batch_width`); rows the controller chose for are cut, a
        pinned row too (its k was never more than a budget)."""
        members = list(plan.lookups)
        expected = [
            controller.lookup_tokens(plan.names[b], rows[b].request.route, plan.lookups[b].probs)
            for b in members
        ]
        width = controller.batch_width(len(rows), expected, len(rows) - len(members), packs)
        for b in members:
            if len(plan.lookups[b].tokens) > width:
                Proposers._set_lookup(plan, b, plan.lookups[b], width)

    @staticmethod
    def _take(
        plan: StepPlan, b: int, name: str, found: Continuation | None, k: int | None = None
    ) -> None:
        plan.names[b] = name
        if found is None:
            return
        Proposers._set_lookup(plan, b, found, len(found.tokens) if k is None else k)

    @staticmethod
    def _set_lookup(plan: StepPlan, b: int, found: Continuation, k: int) -> None:
        """Row ``b`` verifies the first ``k`` tokens of ``found`` (none when k is 0)."""
        k = min(k, len(found.tokens))
        plan.spec_k[b] = k
        if k > 0:
            plan.lookups[b] = found.cut(k)
        else:
            plan.lookups.pop(b, None)

    @staticmethod
    def fill(plan: StepPlan, ids: torch.Tensor, probs: torch.Tensor, drafted: torch.Tensor) -> None:
        """Writes the looked-up drafts into a step's draft tensors: tokens into ``ids``
        (B, K, k), q one-hot into ``probs`` (B, K, k, V), their counts into ``drafted`` (B,)."""
        if not plan.lookups:
            return
        members = [(b, i, t) for b, c in plan.lookups.items() for i, t in enumerate(c.tokens)]
        where = to_device(torch.tensor(members, dtype=torch.int64), ids.device)  # (N, 3)
        b, i, t = where[:, 0], where[:, 1], where[:, 2]
        ids[b, 0, i] = t
        probs[b, 0, i] = 0
        probs[b, 0, i, t] = 1
        counts = to_device(
            torch.tensor([[b, len(c.tokens)] for b, c in plan.lookups.items()]), ids.device
        )
        drafted[counts[:, 0]] = counts[:, 1]

    def learn(self, row: Row) -> None:
        """Takes a finished request's prompt and output into the shared stores."""
        for lookup in self.lookups.values():
            lookup.learn(row.seq, row.request.route)

    def warm(self, documents: Sequence[tuple[Sequence[int], str]]) -> None:
        """Takes earlier requests' tokens (and routes), oldest first, as older than anything
        learned so far: built aside, then put in front of the stores in one step each, so
        the decode thread may go on learning and looking up meanwhile."""
        for lookup in self.lookups.values():
            if lookup.shared:
                lookup.warm(documents)
