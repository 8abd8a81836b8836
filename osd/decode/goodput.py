"""How many tokens to draft: a goodput controller over live acceptance and step costs.

For each row at each step it picks k in {0, ..., k_max} maximising expected tokens per second
(the shortest k within ``tolerance`` of the best: near the optimum the rate is flat in k and the
estimates are noisy),
``E[tokens | k] / cost(k)`` with ``E[tokens | k] = 1 + sum_{i<=k} prod_{j<=i} a_j``
(docs/algorithms.md, "Goodput"). ``a_j`` is the acceptance at position j given those before
it were accepted, counted live per (adapter version, route) with a prior, so a new version is
tried and a better draft is noticed; ``cost(k)`` is the measured seconds of a step that drafts
k tokens at the current batch size (a line fitted to recent steps). The choice depends only on
past statistics, never on the target's output for the step it decides, so every verifier stays
exact. Exploration runs on one engine-wide schedule: once every ``probe_every`` steps rows
that would draft nothing draft one token (is the draft better now? A route whose probes keep
finding the draft bad is probed half as often after each, down to one probe step in
``2 ** max_backoff``); once every ``zero_probe_every`` steps rows that would draft run the
target alone (what does a step without drafting cost? Without it a controller that drafts never
measures the alternative; that cost drifts slowly, so this probe is rarer); and once every
``width_probe_every`` steps rows that draft draft one token more or one less. All rows probe on
the same steps: probes spread over rows would make most steps of a batch pay for drafting.
Before a batch size has been measured its costs are borrowed from the nearest measured one, and
before anything is measured from a prior ratio, so a cold replica does not start at ``max_k``;
once anything is measured, a batch size drafts only after a step without drafting of its own
(the base its costs and the realized-gain guard price drafting against).
Deterministic given its inputs; pure (no clocks: the caller passes measured seconds). With k
chosen from live statistics a seed fixes a request's output distribution, not its exact text.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = [
    "AcceptanceCurve",
    "GoodputController",
    "StepCosts",
    "best_k",
    "expected_tokens",
    "shortest_good",
]


# Per step, what the exploration share's sums keep of their past (GoodputController).
_EXPLORE_KEEP = 0.9999
# The realized-gain guard (GoodputController.held_off): per step, what its sums keep of their
# past (about 500 steps), and the drafting steps' weight it needs before it judges.
_GAIN_KEEP = 0.998
_GAIN_EVIDENCE = 4.0


def expected_tokens(acceptance: list[float], k: int) -> float:
    """Expected tokens a step emits when drafting k: 1 + sum over i <= k of prod a_1..a_i."""
    total, survive = 1.0, 1.0
    for rate in acceptance[:k]:
        survive *= rate
        total += survive
    return total


def best_k(acceptance: list[float], step_seconds: list[float], tolerance: float = 0.0) -> int:
    """The shortest k (index into ``step_seconds``) whose expected tokens per second is within
    ``tolerance`` (a share) of the most; 0: the k with the most."""
    rates = [expected_tokens(acceptance, k) / max(s, 1e-9) for k, s in enumerate(step_seconds)]
    return shortest_good(rates, tolerance)


def shortest_good(rates: list[float], tolerance: float) -> int:
    """The shortest width whose rate (``rates[w]``: tokens per second drafting w) is within
    ``tolerance`` (a share) of the most."""
    good_enough = max(rates) * (1 - tolerance)
    return next(w for w, rate in enumerate(rates) if rate >= good_enough)


@dataclass
class AcceptanceCurve:
    """Per-position acceptance of one draft on one route, counted with exponential forgetting.

    Attributes:
        reached: (weighted) steps in which position i + 1 was drafted with 1..i accepted.
        accepted: (weighted) steps in which position i + 1 was accepted too.
        backoff: while the draft is off (k = 0) on this route, it is probed on one probe step
            in ``2 ** backoff`` (each probe that leaves it off doubles the wait, up to a cap).
    """

    max_k: int
    reached: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)
    backoff: int = 0
    last_probe: int = -1  # the engine step of the last probe (one backoff step per probe)

    def __post_init__(self) -> None:
        self.reached = self.reached or [0.0] * self.max_k
        self.accepted = self.accepted or [0.0] * self.max_k

    def observe(self, num_drafted: int, num_accepted: int, decay: float) -> None:
        """One step: ``num_drafted`` offered, the first ``num_accepted`` of them kept."""
        if num_drafted == 0:
            return
        for i in range(self.max_k):
            self.reached[i] *= decay
            self.accepted[i] *= decay
        for i in range(min(num_drafted, self.max_k, num_accepted + 1)):
            self.reached[i] += 1.0
            self.accepted[i] += 1.0 if num_accepted > i else 0.0

    def rates(self, prior: float, prior_weight: float) -> list[float]:
        """a_1..a_max_k: position 1's counts shrunk towards ``prior`` by ``prior_weight``
        pseudo-steps, each later position's towards the estimate before it.

        A chained prior: a position with little evidence is assumed as good as the one before
        it, not as the optimistic prior. With a constant prior a draft that fails at position 1
        kept positions 2..k at that prior (they are only reached when position 1 is accepted),
        so one noisy cost estimate could make k = max_k look worth it.
        """
        out, previous = [], prior
        for reached, accepted in zip(self.reached, self.accepted, strict=True):
            previous = (accepted + previous * prior_weight) / (reached + prior_weight)
            out.append(previous)
        return out


@dataclass
class StepCosts:
    """Seconds of a step by its width k, per batch-size bucket, from recent steps.

    Steps that draft nothing are averaged on their own: drafting at all has a fixed cost (the
    draft's forwards over pending tokens, the bookkeeping), so a line through k = 0 would
    understate the cost of k = 1. Steps that draft are fitted as a line in k. Until a kind of
    step has been seen in a bucket, it is estimated from the other with ``prior_ratio``: a
    drafted token costs that share of a step that drafts nothing.
    """

    prior_ratio: float = 0.25
    # A token proposed without a model (osd.decode.proposers) costs only its place in the
    # target's forward: per position a row verifies, this share of a step times the batch
    # (measured on the demo pair at 16 rows with packed forwards: 0.2, i.e. 0.0125 x 16).
    free_prior_ratio: float = 0.015
    decay: float = 0.98
    free_decay: float = 0.95  # per step with looked-up drafts (their line's memory)
    # Per step of any kind at the batch size's bucket, the looked-up line's evidence and its
    # prior fade together (the line itself does not change until a step of its own comes,
    # and never fades back to the prior), so a step with looked-up drafts after a long gap
    # (a probe) outweighs the steps before it. Without it, 16 greedy rows of repetitive
    # traffic priced their lookups off for the whole run from a few slow steps of their first
    # 70, in about half the runs: a probe at 1 position a row, 20 ms against a base of 12,
    # moved a line at 17 ms a position by a twentieth (the same traffic drafting took 1.24x
    # the target alone's tokens/s, not drafting 0.95x).
    free_age: float = 0.99
    # A step counts at most this many times its estimate (once its bucket's step without
    # drafting is measured): served, a step can take 3-5x its due (the replica's other
    # threads, a first call of a shape, a full garbage collection: 165 ms against 5), and
    # the drafting lines forget only with their own steps, which such an outlier could keep
    # from ever coming again. A step without drafting is cut too: while rows draft, such
    # steps are few, and one collection in them raised the base the guard prices drafting
    # against by a third (16 sampled rows drafted at 0.77x the target alone, judged 1.2x).
    outlier_ratio: float = 2.0
    _zero: dict[int, list[float]] = field(default_factory=dict)  # bucket: weight, seconds
    _line: dict[int, list[float]] = field(default_factory=dict)  # bucket: w, k, kk, t, kt
    # The same with no draft forward, and the weight of its prior (1 when new).
    _free: dict[int, list[float]] = field(default_factory=dict)

    @staticmethod
    def bucket(batch: int) -> int:
        """Batch sizes 1, 2, 3-4, 5-8, 9-16, ...: one bucket per power of two."""
        return max(batch - 1, 0).bit_length()

    def observe(self, batch: int, k: float, seconds: float, model: bool = True) -> None:
        """One step whose rows verified k drafted positions each (its width, or their mean
        where the target's forward computed only the positions rows have); ``model``: the
        draft model ran (else the drafts were looked up)."""
        seconds = min(seconds, self.ceiling(batch, k, model))
        bucket = self.bucket(batch)
        # Steps without drafting are averaged over recent steps. The drafting kinds forget
        # only as their own steps come: probes (GoodputController) measure them again. A line
        # faded back to its optimistic prior at every step had whole batches draft (or verify
        # wide lookups) on text that accepted nothing, every hundred steps or so.
        for i, value in enumerate(self._zero.get(bucket, ())):
            self._zero[bucket][i] = value * self.decay
        free = self._free.get(bucket)
        if free is not None:  # evidence and prior alike: the line stays as it is
            free[:] = [value * self.free_age for value in free]
            if free[0] + free[-1] < 1e-200:  # long idle: the same line at a readable scale
                free[:] = [value * 1e200 for value in free]
        if k > 0:
            kind, keep = (self._line, self.decay) if model else (self._free, self.free_decay)
            for i, value in enumerate(kind.get(bucket, ())):
                kind[bucket][i] = value * keep
        if k == 0:
            values = [1.0, seconds]
            sums = self._zero.setdefault(bucket, [0.0] * 2)
        else:
            values = [1.0, k, k * k, seconds, k * seconds]
            lines = self._line if model else self._free
            sums = lines.setdefault(bucket, [0.0] * 5 + ([] if model else [1.0]))
        for i, value in enumerate(values):
            sums[i] += value

    def ceiling(self, batch: int, k: float, model: bool = True) -> float:
        """The most seconds a step drafting k (``model``: with the draft model; k = 0: a step
        without drafting) is counted as: ``outlier_ratio`` times its estimate, where the batch
        size's own step without drafting is measured (else no limit: the estimate is the
        prior's)."""
        base = self.own_base(batch)
        if base is None:
            return math.inf
        if k <= 0:
            return self.outlier_ratio * base
        if model:
            _, intercept, slope = self._model_line(batch)
            expected = intercept + slope * k
        else:
            expected = self.free_cost(batch, k)
        return self.outlier_ratio * expected

    def own_base(self, batch: int) -> float | None:
        """Seconds of a step without drafting measured at this batch size's bucket (None:
        none measured there)."""
        zero = self._zero.get(self.bucket(batch))
        return zero[1] / zero[0] if zero else None

    def lacks_base(self, batch: int) -> bool:
        """No step without drafting was measured at this batch size: the costs would be the
        prior's ratios to a base read off the drafting steps or a neighbour's, which is how a
        cold replica went on drafting at 16 sampled rows for a hundred steps at 1.6x the
        target alone's step; and the realized-gain guard cannot judge drafting there
        (:meth:`GoodputController.held_off`). That included batch sizes whose every drafting
        step catches the draft up (left out of the line): with 2 clients, the one-row steps
        between two requests drafted k = 1-2 after reading 40-120 tokens first, all
        measurement long, unjudged. One step without drafting measures it. (A controller
        that has measured nothing yet starts from its priors.)"""
        return self.bucket(batch) not in self._zero and bool(self._zero or self._line)

    def seconds(self, batch: int, max_k: int) -> list[float]:
        """Estimated step seconds for k = 0..max_k at this batch size.

        A bucket not measured yet borrows the nearest measured one (the choice depends on the
        costs' ratios, which change slowly with the batch); with nothing measured, the prior
        alone: 1 for a step without drafting, ``prior_ratio`` more per drafted token.
        """
        base, intercept, slope = self._model_line(batch)
        return [base] + [intercept + slope * k for k in range(1, max_k + 1)]

    def _model_line(self, batch: int) -> tuple[float, float, float]:
        """(seconds without drafting, the draft model's line: intercept, slope per k)."""
        measured = self._zero.keys() | self._line.keys()
        if not measured:
            return 1.0, 1.0, self.prior_ratio
        wanted = self.bucket(batch)
        bucket = min(measured, key=lambda b: (abs(b - wanted), -b))
        zero, line = self._zero.get(bucket), self._line.get(bucket)
        base = zero[1] / zero[0] if zero else None
        fitted = self._fit(line, base)
        if fitted is None:
            assert base is not None  # the bucket was measured: one of the two kinds is
            fitted = (base, self.prior_ratio * base)
        intercept, slope = fitted
        if base is None:  # no step without drafting seen: the line less one drafted token
            base = intercept / (1 + self.prior_ratio)
        return base, intercept, slope

    def free_seconds(self, batch: int, max_k: int) -> list[float]:
        """Estimated step seconds for k = 0..max_k when the k tokens come without a model.

        A step without drafting; then, for k >= 1, that base plus a fixed cost (a step that
        verifies anything leaves the target-alone path: the verifiers' draws and tensors, a
        forward with more than one position per row) plus a slope per position each row
        verifies, both fitted to the excess over the base of steps in which no draft forward
        ran at this batch size's bucket, by least squares with the prior as one pseudo-step at
        k = 1. Until such steps are measured there, or while they all verified about one
        width, the slope is ``free_prior_ratio`` of the base per token and row (a position
        costs every row of a padded batch one more token in the forward) and the rest of their
        excess is the fixed cost. Measured on the demo pair at 16 sampled rows: one row
        verifying one looked-up token made the step 48 % dearer, nearly all of it fixed.
        """
        base, fixed, slope = self._free_line(batch)
        return [base] + [base + fixed + slope * k for k in range(1, max_k + 1)]

    def free_cost(self, batch: int, extra: float) -> float:
        """Estimated seconds of a step without a draft forward whose rows verify ``extra``
        looked-up positions each on average (a fraction where a packed forward computes only
        the positions rows have: :func:`osd.decode.kv_cache.packing`); 0: the base."""
        base, fixed, slope = self._free_line(batch)
        return base if extra <= 0 else base + fixed + slope * extra

    def _free_line(self, batch: int) -> tuple[float, float, float]:
        """(seconds without drafting, fixed seconds of verifying anything, seconds per
        looked-up position a row verifies)."""
        base = self.seconds(batch, 0)[0]
        prior = base * min(1.0, self.free_prior_ratio * batch)
        # Only this batch size's own steps: another's were lent first in seconds (16 rows'
        # excess priced a lone row's lookup at 3-7x its step), then as shares of their base,
        # and a few slow warm-up steps still priced lookups out at one row for good (their
        # probes wait on the exploration share). The prior is optimistic; a step corrects it.
        w, k, kk, t, kt, p = self._free.get(self.bucket(batch), (0.0,) * 5 + (1.0,))
        weight, k_sum, kk_sum = p + w, p + k, p + kk  # the prior: p steps at k = 1
        excess, k_excess = p * prior + t - base * w, p * prior + kt - base * k
        mean_k, mean_excess = k_sum / weight, excess / weight
        # The slope is shrunk towards the prior's by p steps a position apart (a ridge): a
        # least-squares slope through a few steps a fraction of a position apart follows
        # their noise (three such steps of 15-27 ms on a base of 8 fit 15 ms a position,
        # pricing every lookup out: tests/decode/test_goodput.py), and probes at one position
        # a row move the line's mean, never its slope (GoodputController._probing_wide).
        spread = kk_sum - weight * mean_k * mean_k
        covariance = k_excess - weight * mean_k * mean_excess
        slope = max((covariance + p * prior) / (spread + p), 0.0)
        return base, max(mean_excess - slope * mean_k, 0.0), slope

    def _fit(self, sums: list[float] | None, base: float | None) -> tuple[float, float] | None:
        if not sums:
            return None
        weight, k_sum, kk_sum, t_sum, kt_sum = sums
        mean_k, mean_t = k_sum / weight, t_sum / weight
        variance = kk_sum / weight - mean_k * mean_k
        if variance > 1e-6:
            slope = max((kt_sum / weight - mean_k * mean_t) / variance, 0.0)
        else:  # one width seen: the prior's share per token, of a step without drafting
            if base is None:
                base = mean_t / (1 + self.prior_ratio * (1 + mean_k))
            slope = self.prior_ratio * base
        return max(mean_t - slope * mean_k, 1e-9), slope


@dataclass
class GoodputController:
    """Chooses k per row from live acceptance per (adapter, route) and measured step costs.

    Args:
        max_k: the largest k it may choose.
        prior: acceptance a new draft version is assumed to have (optimistic, so it is tried).
        prior_weight: pseudo-steps of that prior.
        decay: forgetting per observed step of a curve (recent traffic counts most).
        probe_every: engine steps between steps in which rows that would draft nothing
            draft one token (module docstring).
        zero_probe_every: engine steps between steps in which rows that would draft run the
            target alone.
        max_backoff: a route whose draft stays off is probed on one probe step in at most
            ``2 ** max_backoff`` (every ``probe_every * 2 ** max_backoff`` engine steps).
        width_probe_every: engine steps between steps in which rows that draft draft one
            token more or one less (alternately).
        tolerance: the shortest k whose expected rate is within this share of the best wins.
        explore_share: the most of the decode time probes may cost: a probe step's seconds
            beyond a step without drafting (a draft probe's include the draft's catch-up over
            every token its rows took without it) count against it, and a probe the share
            cannot pay for yet waits for a later probe step. Speculation that does not help
            thus costs at most about this share for being tried (issue 31: never slower).
        guard_margin: drafting at a batch size is held off (probes aside) while its recent
            steps emitted less than ``1 - guard_margin`` of the tokens the target alone would
            have in their time (:meth:`held_off`).
    """

    max_k: int = 8
    # Optimistic: a new version must get drafted to be measured. At 0.6 the demo pair (a
    # drafted token costs about half a target step there) kept new adapter versions that
    # accepted 0.8 at k = 0 for tens of requests, learning from one-token probes only.
    prior: float = 0.9
    prior_weight: float = 4.0
    decay: float = 0.995
    probe_every: int = 32
    zero_probe_every: int = 128
    max_backoff: int = 3
    width_probe_every: int = 16
    # Near its best, tokens/s is flat in k while the estimates are noisy, deep positions most:
    # the shortest k within 3 % of the best is chosen (on the demo pair the plain argmax
    # drafted 5-7 where 3-4 were best, 10 % slower; and k = 0 wins its near-ties).
    tolerance: float = 0.03
    explore_share: float = 0.01
    guard_margin: float = 0.02
    costs: StepCosts = field(default_factory=StepCosts)
    curves: dict[tuple[str, str], AcceptanceCurve] = field(default_factory=dict)
    # Per (model-free proposer, route): [tokens accepted, tokens its probabilities predicted],
    # decayed like the curves: how far to trust a lookup's empirical probabilities.
    calibration: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    steps: int = 0  # steps observed: the probe schedule
    # Decayed seconds of all steps and of probe steps' excess over a step without drafting.
    _explore_total: float = 0.0
    _explore_spent: float = 0.0
    _probed: bool = False  # this step took a probe
    _probe_excess: float = 0.0  # the last probe step's seconds beyond the base
    _lookup_probed: bool = False  # this step took a lookup probe
    _lookup_probes: int = 0  # lookup probe steps so far (_probing_wide)
    # Per batch-size bucket, over recent drafting steps that were not probes:
    # [weight, tokens emitted, tokens the target alone would have emitted in their seconds].
    _gain: dict[int, list[float]] = field(default_factory=dict)
    _chosen: dict[tuple[str, str, int, int], int] = field(default_factory=dict)  # this step's
    # This step's (draft model's tokens/s, seconds by looked-up width), by the same four and
    # the lookups' cap.
    _compared: dict[tuple[str, str, int, int, int], tuple[float, list[float]]] = field(
        default_factory=dict
    )
    # This step's lookups_could_pay, by batch, cap, route and proposers.
    _could_pay: dict[tuple[int, int, str, tuple[str, ...]], bool] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_backoff < 0:
            raise ValueError(f"need max_backoff >= 0, got {self.max_backoff}")
        if self.width_probe_every < 4 or self.width_probe_every % 2 or self.probe_every % 2:
            raise ValueError(
                f"need even probe_every and width_probe_every >= 4, got {self.probe_every}, "
                f"{self.width_probe_every}"
            )
        if self.probe_every < 2 or self.zero_probe_every < self.probe_every:
            raise ValueError(
                f"need 2 <= probe_every <= zero_probe_every, got {self.probe_every}, "
                f"{self.zero_probe_every}"
            )

    def curve(self, adapter: str, route: str) -> AcceptanceCurve:
        key = (adapter, route)
        if key not in self.curves:
            self.curves[key] = AcceptanceCurve(self.max_k)
        return self.curves[key]

    def choose(self, adapter: str, route: str, batch: int, limit: int) -> int:
        """k for one row this step (at most ``limit``: e.g. the tokens left minus one)."""
        limit = min(limit, self.max_k)
        if limit <= 0:
            return 0
        key = (adapter, route, batch, limit)
        if key not in self._chosen:  # rows of one step mostly share all four
            self._chosen[key] = self._choose(adapter, route, batch, limit)
        return self._chosen[key]

    def _choose(self, adapter: str, route: str, batch: int, limit: int) -> int:
        curve = self.curve(adapter, route)
        rates = curve.rates(self.prior, self.prior_weight)
        k = best_k(rates, self.costs.seconds(batch, limit), self.tolerance)
        if k > 0 and self.costs.lacks_base(batch):
            return 0  # a step without drafting is measured first (StepCosts.lacks_base)
        if k > 0 and self.held_off(batch):
            k = 0  # drafting lost here of late: probes alone (below)
        if k > 0:
            curve.backoff = 0
            if self.steps % self.zero_probe_every == self.probe_every - 1:
                return 0  # on a step the drafting probe never takes (probe_every // 2 apart)
            if self.steps % self.width_probe_every == self.width_probe_every // 2 - 1:
                # One width either side, alternately: keeps the cost line and the acceptance of
                # the next position measured around the choice (without it a controller that
                # settled on k = 1 saw too little of wider steps to leave it).
                wider = (self.steps // self.width_probe_every) % 2 == 0
                return min(k + 1, limit) if wider else max(k - 1, 1)
            return k
        if self.steps % self.probe_every != self.probe_every // 2 - 1:
            return 0
        if curve.last_probe == self.steps:  # another row of this step: the same probe
            return 1
        if (self.steps // self.probe_every) % (1 << curve.backoff) == 0 and self._may_explore():
            curve.last_probe = self.steps
            curve.backoff = min(curve.backoff + 1, self.max_backoff)
            self._probed = True
            return 1
        return 0

    def choose_proposer(
        self,
        adapter: str,
        route: str,
        batch: int,
        limit: int,
        offers: list[tuple[str, tuple[float, ...]]],
        free_limit: int | None = None,
    ) -> tuple[str, int]:
        """The proposer and k for one row: the draft model (``"draft"``, k from :meth:`choose`,
        at most ``limit``) or one of the model-free ``offers`` (name, cumulative probability
        of each proposed prefix; at most ``free_limit`` tokens, None: as the draft model's),
        whichever maximises expected tokens per second.

        A model-free proposal of m tokens is expected to yield ``1 + sum_i min(1, f * c_i)``
        tokens, with c_i its prefix probabilities and f this route's calibration of them
        (accepted over predicted, prior 1); it costs a step without a draft forward plus its
        m positions in the target's forward (:meth:`StepCosts.free_seconds`). On one step in
        ``probe_every`` (a phase of its own) a row with an offer takes it, so a calibration
        or cost that fell is measured again: at least one token, and on every other such
        probe step the whole proposal (:meth:`_probing_wide`).
        """
        k = self.choose(adapter, route, batch, limit)
        if not offers:
            return "draft", k
        free_limit = min(limit, self.max_k) if free_limit is None else free_limit
        key = (adapter, route, batch, limit, free_limit)
        if key not in self._compared:  # rows of one step mostly share all five
            model_seconds = self.costs.seconds(batch, min(limit, self.max_k))
            rates = self.curve(adapter, route).rates(self.prior, self.prior_weight)
            self._compared[key] = (
                expected_tokens(rates, k) / max(model_seconds[k], 1e-9),
                self.costs.free_seconds(batch, free_limit),
            )
        draft_rate, free_seconds = self._compared[key]
        best = ("draft", k, draft_rate)
        probing = self._probing_lookups()
        wide = probing and self._probing_wide()
        if not probing and self.held_off(batch):
            return best[0], best[1]
        for name, probs in offers:
            m, rate = self._free_choice(name, route, probs[:free_limit], free_seconds)
            if probing:  # a cost or calibration that fell is measured again (_probing_wide)
                m, rate = (len(probs[:free_limit]) if wide else max(m, 1)), math.inf
                self._probed = self._lookup_probed = True
            if m and rate >= best[2]:
                best = (name, m, rate)
        return best[0], best[1]

    def lookup_tokens(self, name: str, route: str, probs: tuple[float, ...]) -> list[float]:
        """Expected tokens of a step that drafts the first m tokens of a model-free proposal,
        m = 0..len(probs): ``1 + sum_{i<m} min(1, f * c_i)`` (see :meth:`choose_proposer`)."""
        factor = self._calibration(name, route)
        out = [1.0]
        for p in probs:
            out.append(out[-1] + min(1.0, factor * p))
        return out

    def _calibration(self, name: str, route: str) -> float:
        """f: how many tokens a lookup's predicted token is worth on this route (accepted
        over predicted, with ``prior_weight`` pseudo-tokens of 1)."""
        accepted, predicted = self.calibration.get((name, route), (0.0, 0.0))
        return (accepted + self.prior_weight) / (predicted + self.prior_weight)

    def batch_width(
        self, batch: int, expected: list[list[float]], others: int, packed: bool = False
    ) -> int:
        """The widest lookup a step of ``batch`` rows should verify. ``expected``: each lookup
        row's expected tokens by m (:meth:`lookup_tokens`); ``others``: rows expecting one
        token. Maximises the batch's expected tokens per second over the measured step costs:
        where rows are padded to the widest (``packed`` False), one long proposal widens the
        target's forward for all (on a CPU at 16 rows, 9 positions a row cost about 2.4x one);
        where the forward computes only the positions rows have, each row pays for its own."""
        widest = max(len(e) for e in expected) - 1
        rates = []
        for w in range(widest + 1):
            tokens = others + sum(e[min(w, len(e) - 1)] for e in expected)
            extra = sum(min(w, len(e) - 1) for e in expected) / batch if packed else w
            rates.append(tokens / max(self.costs.free_cost(batch, extra), 1e-9))
        width = shortest_good(rates, self.tolerance)
        if self._probing_lookups():
            return widest if self._probing_wide() else max(width, 1)
        return 0 if self.held_off(batch) else width

    def held_off(self, batch: int) -> bool:
        """Drafting at this batch size lost to the target alone of late: its recent drafting
        steps (probes aside; catch-ups counted, they are what drafting costs) emitted less
        than ``1 - guard_margin`` of the tokens the target alone would have emitted in their
        seconds. A guard on realized tokens, not on the estimates: at 16 sampled rows a
        model of acceptance and step costs, each estimate noisy, let whole batches draft (or
        verify lookups) that cost 1.5-3x a step for 1.1x its tokens, as rows joined a batch
        with their prompts unread. While held off only probes draft; the sums fade (about
        500 steps) below their evidence and the controller's choices are tried again (about
        110 steps after it held drafting off). Per batch size, not per route: a slower fade
        after each hold (tried, ``docs/benchmarks.md``) would keep code and SQL rows' lookups
        off for as long as prose rows at the same batch size had lost."""
        sums = self._gain.get(StepCosts.bucket(batch))
        if sums is None or sums[0] < _GAIN_EVIDENCE:
            return False
        return sums[1] < (1 - self.guard_margin) * sums[2]

    def wants_lookups(self, batch: int) -> bool:
        """Whether a step of ``batch`` rows could take a looked-up draft: not while drafting is
        held off there (:meth:`held_off`), but on the lookups' probe steps. Rows skip their
        lookups otherwise (a sixth of :meth:`Proposers.plan`'s time, for nothing)."""
        return not self.held_off(batch) or self._probing_lookups()

    def lookups_could_pay(
        self, batch: int, max_tokens: int, route: str, names: Sequence[str]
    ) -> bool:
        """Whether a row of ``route`` in a step of ``batch`` rows should look its draft up
        (with the proposers ``names``, at most ``max_tokens``): whether some width m, each
        position expected at its best (``min(1, f)`` tokens, f the route's calibration:
        :meth:`lookup_tokens`), would emit tokens at least as fast as a step without drafting
        at this batch size's measured costs (:meth:`StepCosts.free_seconds`); always on the
        lookups' probe steps. No offer expects more, and the draft model's choice is never
        slower than k = 0, so where this fails :meth:`choose_proposer` takes no offer: the
        row skips the lookup, and no choice changes. Measured (demo pair, 16 greedy rows of
        repetitive traffic, one thread): the rows' lookups took 2 % of each step while the
        controller, calibrated to 0.42 of their probabilities, took none of them."""
        if self._probing_lookups():
            return True
        key = (batch, max_tokens, route, tuple(names))
        found = self._could_pay.get(key)
        if found is None:
            per_position = min(1.0, max(self._calibration(name, route) for name in names))
            free = self.costs.free_seconds(batch, max_tokens)
            base = free[0]
            found = self._could_pay[key] = any(
                (1 + m * per_position) * base >= free[m] * (1 - 1e-9) for m in range(1, len(free))
            )
        return found

    def _probing_lookups(self) -> bool:
        """One step in ``probe_every`` (a phase of its own) looked-up drafts are taken even
        where the estimates advise against them, so estimates that fell are measured again
        (while the exploration share allows)."""
        return self.steps % self.probe_every == self.probe_every - 3 and self._may_explore()

    def _probing_wide(self) -> bool:
        """Every other lookup probe takes each row's whole proposal (the first of them too),
        the others at least one token. Only steps of different widths measure the cost
        line's slope: probes all at one position a row moved its mean, never its slope. At 16
        greedy rows of repetitive traffic one dear step at 3 positions a row (52 ms on a base
        of 8, where 7 positions took 25: the KV cache grew in it) set a slope that priced
        every lookup out, and the probes left it so for the rest of the run."""
        return self._lookup_probes % 2 == 0

    def _may_explore(self) -> bool:
        """Probes so far, and one more as dear as the last, cost at most ``explore_share`` of
        the decode time."""
        spent = self._explore_spent + self._probe_excess
        return spent <= self.explore_share * self._explore_total

    def _free_choice(
        self, name: str, route: str, probs: tuple[float, ...], seconds: list[float]
    ) -> tuple[int, float]:
        """(m, tokens per second) of the best prefix of a model-free proposal."""
        tokens = self.lookup_tokens(name, route, probs[: len(seconds) - 1])
        rates = [tokens[m] / max(seconds[m], 1e-9) for m in range(len(tokens))]
        m = shortest_good(rates, self.tolerance)
        return m, rates[m]

    def observe_free(self, name: str, route: str, predicted: float, num_accepted: int) -> None:
        """One step of a model-free proposal: the probabilities it drafted with summed, and
        the tokens kept."""
        sums = self.calibration.setdefault((name, route), [0.0, 0.0])
        sums[0] = sums[0] * self.decay + num_accepted
        sums[1] = sums[1] * self.decay + predicted
        self._forget_step()

    def observe_row(self, adapter: str, route: str, num_drafted: int, num_accepted: int) -> None:
        self.curve(adapter, route).observe(num_drafted, num_accepted, self.decay)
        self._forget_step()

    def observe_step(
        self,
        batch: int,
        k: float,
        seconds: float,
        model: bool = True,
        catching_up: bool = False,
        emitted: int = 0,
        riding: bool = False,
        explorable: float = 1.0,
        grew: bool = False,
    ) -> None:
        """A step whose rows verified k drafted positions each took ``seconds``
        (:meth:`StepCosts.observe`); ``model``: the draft model ran in it. ``catching_up``:
        the draft read many tokens a row first (rows back on the draft after steps without
        it): its seconds count against the exploration share if it probed, but not in the
        cost line, which prices drafting step after step (a line fitted to probes, each with
        its rows' catch-up, kept a good draft off at 16 rows). ``emitted``: the tokens the
        step's rows emitted (the realized-gain guard, :meth:`held_off`). ``riding``: a
        joining prompt was read in the step (:mod:`osd.decode.loop`): its seconds say nothing
        of drafting's cost, so neither the cost line, the guard nor a probe's excess take them
        (counted as drafting, the rider steps' prompts held the demo's drafting off: 1.11x the
        reference requests against 2.2x). ``explorable``: the share of the step's rows whose k
        the controller chose; only their share of its seconds earns probes their budget (rows
        of the target alone, beside them on one replica, gave drafting's probes twice the
        share of its requests' time). ``grew``: a KV cache's storage grew in the step
        (:class:`osd.decode.kv_cache.SlotKVCache`), taken as ``riding`` is: a one-off of the
        rows' length, not of the step's kind (16 repetitive rows' first verify step at 3
        positions a row took 52 ms against 25 for 7 later, and priced their lookups out)."""
        aside = riding or grew
        # Remembered over about 10,000 steps: the share holds over many probe intervals
        # (a short memory would let each probe through once its cost had faded).
        self._explore_total = self._explore_total * _EXPLORE_KEEP + seconds * explorable
        self._explore_spent *= _EXPLORE_KEEP
        bucket = StepCosts.bucket(batch)
        gain = self._gain.setdefault(bucket, [0.0, 0.0, 0.0])
        for i, value in enumerate(gain):
            gain[i] = value * _GAIN_KEEP
        base = self.costs.own_base(batch)  # not a prior's or a neighbour's
        if k > 0 and emitted and not self._probed and base is not None and not aside:
            for i, value in enumerate((1.0, float(emitted), batch * seconds / max(base, 1e-9))):
                gain[i] += value
        self._lookup_probes += self._lookup_probed
        self._lookup_probed = False
        if self._probed:
            if not aside:
                # What the probe lost: its seconds beyond those the target alone would have
                # taken for the tokens it emitted (a step's base per ``batch`` of them). A
                # probe that gained costs nothing. Counted as its whole excess over the base,
                # a looked-up probe at 16 repetitive rows (25 ms for 7x a step's tokens, on a
                # base of 8) holds the next one back about 200 steps at a 1 % share.
                base_seconds = self.costs.seconds(batch, 0)[0]
                worth = base_seconds * max(emitted / max(batch, 1), 1.0)
                self._probe_excess = max(seconds - worth, 0.0)
                self._explore_spent += self._probe_excess
            self._probed = False
        if not (catching_up or aside):
            self.costs.observe(batch, k, seconds, model)
        self.steps += 1
        self._forget_step()

    def _forget_step(self) -> None:
        """New statistics: this step's choices are made afresh."""
        self._chosen.clear()
        self._compared.clear()
        self._could_pay.clear()
