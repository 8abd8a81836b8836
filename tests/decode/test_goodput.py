"""The goodput controller: pure decisions from acceptance counts and step costs, by tables."""

from __future__ import annotations

import math

import pytest

from osd.decode.goodput import (
    AcceptanceCurve,
    GoodputController,
    StepCosts,
    best_k,
    expected_tokens,
    shortest_good,
)


@pytest.mark.parametrize(
    ("acceptance", "k", "expected"),
    [
        ([0.5, 0.5, 0.5], 0, 1.0),
        ([0.5, 0.5, 0.5], 1, 1.5),
        ([0.5, 0.5, 0.5], 3, 1.875),
        ([1.0, 1.0], 2, 3.0),
        ([0.9, 0.0, 1.0], 3, 1.9),  # nothing survives position 2
    ],
)
def test_expected_tokens_is_one_plus_the_surviving_prefix_mass(acceptance, k, expected):
    assert expected_tokens(acceptance, k) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("rate", "draft_share", "chosen"),
    [
        (0.01, 0.2, 0),  # a draft that never fits: the target alone
        (0.10, 0.2, 0),
        (0.70, 0.2, 3),
        (0.95, 0.05, 8),  # cheap, excellent draft: draft the most
    ],
)
def test_best_k_maximises_tokens_per_second(rate, draft_share, chosen):
    seconds = [1.0 + draft_share * k for k in range(9)]
    assert best_k([rate] * 8, seconds) == chosen


def test_ties_go_to_the_shorter_draft():
    assert best_k([0.0] * 4, [1.0] * 5) == 0


def test_a_tolerance_prefers_the_shortest_near_best_draft():
    seconds = [1.0 + 0.2 * k for k in range(9)]  # rates 1, 1.417, 1.564, 1.583, 1.541, ...
    assert best_k([0.7] * 8, seconds, tolerance=0.0) == 3
    assert best_k([0.7] * 8, seconds, tolerance=0.03) == 2  # 1.564 >= 0.97 * 1.583
    assert best_k([0.7] * 8, seconds, tolerance=0.5) == 0  # the target alone wins near-ties


def test_curve_counts_positions_reached_and_accepted_with_forgetting():
    curve = AcceptanceCurve(max_k=4)
    curve.observe(num_drafted=4, num_accepted=2, decay=1.0)  # positions 1, 2 kept, 3 rejected
    curve.observe(num_drafted=4, num_accepted=4, decay=1.0)
    curve.observe(num_drafted=0, num_accepted=0, decay=1.0)  # the target alone: no evidence
    assert curve.reached == [2, 2, 2, 1]
    assert curve.accepted == [2, 2, 1, 1]
    assert curve.rates(prior=0.5, prior_weight=0.0) == [1.0, 1.0, 0.5, 1.0]
    curve.observe(num_drafted=1, num_accepted=0, decay=0.5)
    assert curve.reached[0] == pytest.approx(2 * 0.5 + 1)


def test_positions_without_evidence_are_assumed_as_good_as_the_one_before():
    curve = AcceptanceCurve(max_k=4)
    for _ in range(40):  # position 1 fails every time: positions 2..4 are never reached
        curve.observe(num_drafted=4, num_accepted=0, decay=1.0)
    rates = curve.rates(prior=0.9, prior_weight=4.0)
    assert rates[0] == pytest.approx(3.6 / 44)
    assert rates[1:] == pytest.approx([rates[0]] * 3)  # not the optimistic 0.9
    assert AcceptanceCurve(max_k=3).rates(prior=0.9, prior_weight=4.0) == [0.9] * 3


def test_step_costs_keep_steps_without_drafting_apart_and_fit_a_line_to_the_others():
    costs = StepCosts(prior_ratio=0.5, decay=1.0)
    assert costs.seconds(batch=4, max_k=2) == pytest.approx([1.0, 1.5, 2.0])  # the prior alone
    costs.observe(batch=4, k=0, seconds=2.0)
    assert costs.seconds(batch=4, max_k=2) == pytest.approx([2.0, 3.0, 4.0])  # prior slope
    costs.observe(batch=3, k=4, seconds=6.0)  # same bucket (3-4 rows), one width: prior slope
    assert costs.seconds(batch=4, max_k=4) == pytest.approx([2.0, 3.0, 4.0, 5.0, 6.0])
    costs.observe(batch=4, k=2, seconds=4.0)  # two widths: a fitted line; k = 0 stays apart
    assert costs.seconds(batch=4, max_k=4) == pytest.approx([2.0, 3.0, 4.0, 5.0, 6.0])
    costs.observe(batch=4, k=1, seconds=4.0)  # drafting at all has a fixed cost
    fitted = costs.seconds(batch=4, max_k=4)
    assert fitted[0] == pytest.approx(2.0) and fitted[1] > 3.0
    # An unmeasured bucket borrows the nearest measured one (ties: the larger batch).
    assert costs.seconds(batch=16, max_k=4) == pytest.approx(fitted)
    costs.observe(batch=16, k=0, seconds=8.0)
    assert costs.seconds(batch=16, max_k=1) == pytest.approx([8.0, 12.0])
    assert costs.seconds(batch=2, max_k=1)[0] == pytest.approx(2.0)  # nearer to 3-4 rows
    assert costs.seconds(batch=6, max_k=1)[0] == pytest.approx(8.0)  # 5-8: a tie, the larger


def run_steps(controller, adapter, route, count):
    """``count`` engine steps of one row; each step costs 1 + 0.1 k. Returns the k chosen."""
    chosen = []
    for _ in range(count):
        chosen.append(controller.choose(adapter, route, batch=1, limit=4))
        controller.observe_step(batch=1, k=chosen[-1], seconds=1.0 + 0.1 * chosen[-1])
    return chosen


def test_controller_stops_drafting_for_a_bad_draft_and_probes():
    controller = GoodputController(  # the schedule alone (no exploration share)
        max_k=4, prior=0.6, prior_weight=4.0, probe_every=8, zero_probe_every=32, explore_share=1
    )
    for k in (0, 2, 4):
        controller.observe_step(batch=1, k=k, seconds=1.0 + 0.1 * k)
    assert controller.choose("v1", "sql", batch=1, limit=4) > 0  # optimistic prior
    for _ in range(200):
        controller.observe_row("v1", "sql", num_drafted=4, num_accepted=0)
    chosen = run_steps(controller, "v1", "sql", 128)  # engine steps 3..130
    # Probe steps are 3, 11, 19, ... (one in 8); each probe that finds the draft still bad
    # doubles the wait, up to one probe step in 2 ** max_backoff = 8.
    assert [i + 3 for i, k in enumerate(chosen) if k] == [3, 19, 35, 67]
    assert set(chosen) == {0, 1}
    for _ in range(200):  # the draft got better on this route (its traffic changed)
        controller.observe_row("v1", "sql", num_drafted=4, num_accepted=4)
    assert controller.choose("v1", "sql", batch=1, limit=4) == 4
    assert controller.curve("v1", "sql").backoff == 0  # probing starts over if it fails again
    assert controller.choose("v2", "sql", batch=1, limit=4) > 0  # a new version is tried
    for _ in range(200):
        controller.observe_row("v1", "code", num_drafted=4, num_accepted=4)
    drafting = run_steps(controller, "v1", "code", 32)  # engine steps 131..162
    # Step 135: the target alone, measured (one in 32; step 135 is also a width probe's, which
    # yields); step 151: one token less, a width probe (one in 16, alternately wider: step 167).
    assert drafting[4] == 0 and drafting[20] == 3
    assert drafting.count(4) == 30


def test_controller_respects_the_limit_and_starts_from_its_priors():
    controller = GoodputController(max_k=8, prior=0.9, costs=StepCosts(prior_ratio=0.25))
    # Nothing measured: acceptance 0.9 and a drafted token costing a quarter of a step; rates
    # 2.05 / 2.08 / 2.09 at k = 4 / 5 / 6, and 4 is within 3 % of the best.
    assert controller.choose("v", "", batch=2, limit=8) == 4
    assert controller.choose("v", "", batch=2, limit=1) == 1
    assert controller.choose("v", "", batch=2, limit=0) == 0
    controller.observe_step(batch=2, k=2, seconds=1.0)
    assert controller.choose("v", "", batch=2, limit=3) <= 3


@pytest.mark.parametrize(
    "schedule",
    [
        {"probe_every": 1, "zero_probe_every": 8},
        {"probe_every": 16, "zero_probe_every": 8},
        {"probe_every": 7},
        {"width_probe_every": 2},
    ],
)
def test_controller_refuses_a_probe_schedule_that_collides(schedule):
    with pytest.raises(ValueError, match="probe_every"):
        GoodputController(**schedule)


def test_the_shortest_good_width_is_the_first_within_the_tolerance():
    assert shortest_good([1.0, 1.05, 1.2], tolerance=0.03) == 2
    assert shortest_good([1.0, 1.18, 1.2], tolerance=0.03) == 1
    assert shortest_good([1.0, 0.9, 0.5], tolerance=0.0) == 0


def test_looked_up_drafts_have_a_fixed_cost_of_verifying_and_keep_it_between_their_steps():
    costs = StepCosts()
    for _ in range(5):
        costs.observe(batch=16, k=0, seconds=1.0)
    # Nothing looked up yet: the prior, a slope per position and no fixed cost.
    assert costs.free_seconds(batch=16, max_k=2) == pytest.approx([1.0, 1.24, 1.48])
    for _ in range(10):  # one row of 16 verifies one looked-up token: the step costs 1.5x
        costs.observe(batch=16, k=1 / 16, seconds=1.5, model=False)
    assert costs.free_cost(batch=16, extra=1 / 16) == pytest.approx(1.5, rel=0.05)
    assert costs.free_cost(batch=16, extra=0) == pytest.approx(1.0)
    # Steps without lookups do not fade it back to the prior (their own steps do).
    for _ in range(300):
        costs.observe(batch=16, k=0, seconds=1.0)
        costs.observe(batch=16, k=2, seconds=2.0)  # the draft model's steps
    assert costs.free_cost(batch=16, extra=1 / 16) == pytest.approx(1.5, rel=0.05)
    for _ in range(200):  # the fixed cost went away (another machine, a cheaper verifier)
        costs.observe(batch=16, k=1 / 16, seconds=1.02, model=False)
    assert costs.free_cost(batch=16, extra=1 / 16) == pytest.approx(1.02, rel=0.02)


@pytest.mark.parametrize("free_age", [0.99, 1.0])
def test_a_looked_up_step_after_a_long_gap_outweighs_the_steps_before_it(free_age: float):
    # 16 greedy rows of repetitive traffic: a few slow looked-up steps among the first (20 ms
    # for half a position a row, against a base of 10) priced every later lookup out, and the
    # probes, a step at one position a row every 30-50 steps, moved the line by a twentieth
    # each: for the whole run. Their evidence and the prior now fade with every step, so the
    # probes after a long gap decide; without steps of its own the line stays as it was.
    costs = StepCosts(free_age=free_age)
    for _ in range(5):
        costs.observe(batch=16, k=0, seconds=0.010)
    for extra in (0.3, 0.4, 0.6, 0.5, 0.3, 0.6, 0.4):
        costs.observe(batch=16, k=extra, seconds=0.020, model=False)
    early = costs.free_cost(batch=16, extra=1.0)
    assert early > 0.018  # a position a row at 1.8x a step's base or more
    for _ in range(100):
        costs.observe(batch=16, k=0, seconds=0.010)
    assert costs.free_cost(batch=16, extra=1.0) == pytest.approx(early)  # not faded
    for _ in range(4):  # probes: a position a row at 1.3x
        for _ in range(40):
            costs.observe(batch=16, k=0, seconds=0.010)
        costs.observe(batch=16, k=1.0, seconds=0.013, model=False)
    late = costs.free_cost(batch=16, extra=1.0)
    if free_age == 1.0:  # negative control: the early steps still decide
        assert late > 0.016
    else:
        assert late == pytest.approx(0.013, rel=0.1)


def test_looked_up_widths_fit_a_fixed_cost_and_a_slope():
    costs = StepCosts(free_decay=1.0)
    costs.observe(batch=16, k=0, seconds=1.0)
    for extra in (0.5, 1.0, 2.0, 4.0) * 5:  # 0.3 fixed, 0.1 per position a row verifies
        costs.observe(batch=16, k=extra, seconds=1.3 + 0.1 * extra, model=False)
    assert costs.free_seconds(batch=16, max_k=3) == pytest.approx([1.0, 1.4, 1.5, 1.6], abs=0.02)


@pytest.mark.parametrize("model", [True, False])
def test_a_slow_drafting_step_counts_at_most_twice_its_estimate(model: bool):
    costs, clean = StepCosts(), StepCosts(outlier_ratio=math.inf)  # clean: nothing cut
    for c in (costs, clean):
        for _ in range(5):
            c.observe(batch=16, k=0, seconds=1.0)
        c.observe(batch=16, k=1, seconds=1.3, model=model)
    estimate = costs.seconds(16, 1)[1] if model else costs.free_seconds(16, 1)[1]
    cap = costs.ceiling(16, 1, model)
    assert cap == pytest.approx(2 * estimate)
    costs.observe(batch=16, k=1, seconds=6.0, model=model)  # the replica's other threads
    clean.observe(batch=16, k=1, seconds=cap, model=model)  # what it is counted as
    assert costs.seconds(16, 1) == pytest.approx(clean.seconds(16, 1))
    assert costs.free_seconds(16, 1) == pytest.approx(clean.free_seconds(16, 1))
    # Costs that really rose are learnt, each step up to twice the last estimate.
    for _ in range(40):
        costs.observe(batch=16, k=1, seconds=6.0, model=model)
    estimate = costs.seconds(16, 1)[1] if model else costs.free_seconds(16, 1)[1]
    assert estimate == pytest.approx(6.0, rel=0.1)
    # Before the batch size's step without drafting is measured nothing is cut.
    cold = StepCosts()
    cold.observe(batch=4, k=1, seconds=6.0, model=model)
    assert cold.ceiling(4, 1, model) == math.inf


def test_a_slow_step_without_drafting_counts_at_most_twice_the_base():
    # clean and uncut cut nothing: clean is fed what costs counts, uncut the raw seconds.
    costs, clean, uncut = StepCosts(), *(StepCosts(outlier_ratio=math.inf) for _ in range(2))
    for c in (costs, clean, uncut):
        for _ in range(5):
            c.observe(batch=16, k=0, seconds=1.0)
    assert costs.ceiling(16, 0) == pytest.approx(2.0)
    costs.observe(batch=16, k=0, seconds=33.0)  # a full garbage collection
    clean.observe(batch=16, k=0, seconds=2.0)  # what it is counted as
    uncut.observe(batch=16, k=0, seconds=33.0)
    assert costs.own_base(16) == pytest.approx(clean.own_base(16))
    assert uncut.own_base(16) > 6.0  # the control: the guard's base six times what it is
    # A base that really rose is learnt, each step up to twice the last.
    for _ in range(60):
        costs.observe(batch=16, k=0, seconds=3.0)
    assert costs.own_base(16) == pytest.approx(3.0, rel=0.05)
    # The first step of a batch size is not cut: nothing to cut it by.
    assert StepCosts().ceiling(4, 0) == math.inf


def test_a_batch_size_without_looked_up_steps_of_its_own_takes_the_prior():
    costs = StepCosts(free_decay=1.0)
    costs.observe(batch=16, k=0, seconds=10.0)
    costs.observe(batch=1, k=0, seconds=2.0)
    for extra in (0.5, 1.0, 2.0, 4.0) * 5:  # at 16 rows: 3 fixed, 1 per position (of 10)
        costs.observe(batch=16, k=extra, seconds=13.0 + extra, model=False)
    assert costs.free_seconds(batch=16, max_k=2) == pytest.approx([10.0, 14.0, 15.0], abs=0.2)
    # A lone row takes the prior (1.5 % of its step a position), not 16 rows' line, in
    # seconds or as shares of their step (either kept a replica from ever taking a lookup
    # at one row, whose probes wait on the exploration share).
    assert costs.free_seconds(batch=1, max_k=2) == pytest.approx([2.0, 2.03, 2.06])
    for _ in range(20):  # its own steps, once measured, are its own
        costs.observe(batch=1, k=1, seconds=2.2, model=False)
        costs.observe(batch=1, k=2, seconds=2.4, model=False)
    assert costs.free_seconds(batch=1, max_k=2) == pytest.approx([2.0, 2.2, 2.4], abs=0.05)


def test_a_batch_size_with_only_drafting_measured_gets_a_step_without_drafting_first():
    controller = GoodputController(max_k=4, prior=0.9)
    controller.observe_step(batch=16, k=1, seconds=2.0)  # drafting measured, the base not
    assert controller.choose("v", "", batch=16, limit=4) == 0
    controller.observe_step(batch=16, k=0, seconds=1.0)
    assert controller.choose("v", "", batch=16, limit=4) > 0  # the prior still says draft


def probe_share(
    explore_share: float, steps: int = 6000, explorable: float = 1.0, told: bool = True
) -> tuple[float, int]:
    """A draft that never helps, whose probe steps cost 10x a step without drafting (its
    catch-up over every token its rows took without it): probes' excess over the seconds of
    the rows the controller chooses for (``explorable`` of each step's; ``told``: the
    controller is told that share)."""
    controller = GoodputController(max_k=4, explore_share=explore_share)
    controller.observe_step(batch=16, k=0, seconds=1.0)
    for _ in range(100):
        controller.observe_row("v", "", num_drafted=4, num_accepted=0)
    excess, total, probes = 0.0, 0.0, 0
    for _ in range(steps):
        k = controller.choose("v", "", batch=16, limit=4)
        seconds = 10.0 if k else 1.0
        if k:
            probes += 1
            excess += seconds - 1.0
            controller.observe_row("v", "", num_drafted=k, num_accepted=0)
        total += seconds * explorable
        controller.observe_step(
            batch=16, k=k, seconds=seconds, explorable=explorable if told else 1
        )
    return excess / total, probes


def test_probes_cost_at_most_the_exploration_share():
    share, probes = probe_share(explore_share=0.01)
    assert share <= 0.011 and probes >= 5  # still probed: a draft that improves is found
    # Negative control: without the share, probes on their schedule cost 3.4 % here.
    unbounded, _ = probe_share(explore_share=1.0)
    assert unbounded > 0.03


def test_rows_of_the_target_alone_earn_probes_no_share():
    # Half of each step's rows ask for the target alone (``spec.method: none``) beside the
    # controller's: the probes' share is of the controller's rows' time only.
    share, probes = probe_share(explore_share=0.01, explorable=0.5)
    assert share <= 0.011 and probes >= 3
    # Negative control: counted whole, such steps paid probes twice the share.
    whole, _ = probe_share(explore_share=0.01, explorable=0.5, told=False)
    assert whole > 0.015


def test_drafting_that_emits_less_than_the_target_alone_would_is_held_off():
    controller = GoodputController(max_k=4, prior=0.9)
    controller.observe_step(batch=16, k=0, seconds=1.0)  # the target alone: 16 tokens a second
    assert controller.choose("v", "", batch=16, limit=4) > 0  # the prior: draft
    for _ in range(6):  # drafting steps cost 2x for 1.2x the tokens (their rows catching up)
        controller.observe_step(batch=16, k=2, seconds=2.0, catching_up=True, emitted=19)
    assert controller.held_off(16) and controller.choose("v", "", batch=16, limit=4) == 0
    name, k = controller.choose_proposer("v", "", 16, 4, [("suffix", (0.99, 0.99))])
    assert (name, k) == ("draft", 0)  # looked-up drafts too (but on their probe steps)
    assert controller.batch_width(16, [[1.0, 2.0, 3.0]], 15) == 0
    # Rows skip their lookups then, but on the lookups' probe steps.
    wanted = []
    for _ in range(controller.probe_every):
        wanted.append(controller.wants_lookups(16))
        controller.steps += 1
    assert wanted.count(True) == 1 and controller.wants_lookups(4)
    assert not controller.held_off(4)  # per batch size
    for _ in range(700):  # the evidence fades: the controller's choices are tried again
        controller.observe_step(batch=16, k=0, seconds=1.0)
    assert not controller.held_off(16)


def test_rows_skip_lookups_that_could_not_pay_at_their_routes_calibration():
    """Where verifying looked-up positions costs more than they could give (each at the
    route's calibration, at most one token), no offer would be taken: rows of that route skip
    looking them up but on the lookups' probe steps (whose measurements may change that)."""
    controller = GoodputController(max_k=4)
    for _ in range(5):
        controller.observe_step(batch=16, k=0, seconds=1.0)
    names = ("suffix",)
    assert controller.lookups_could_pay(16, 8, "", names)  # the priors: sure, and cheap
    for extra in (1.0, 1.5, 2.0) * 5:  # 0.2 fixed and 0.6 per position a row verifies
        controller.observe_step(batch=16, k=extra, seconds=1.2 + 0.6 * extra, model=False)
    assert controller.lookups_could_pay(16, 8, "", names)  # if they were all accepted
    for _ in range(100):  # the route's lookups keep a quarter of what they predict
        controller.observe_free("suffix", "", 4.0, 1)
    wanted = []
    for _ in range(controller.probe_every):
        wanted.append(controller.lookups_could_pay(16, 8, "", names))
        controller.steps += 1
    assert wanted.count(True) == 1  # the lookups' probe step
    # The choice it spares: even an offer sure of all of its tokens is not taken.
    sure = [("suffix", (1.0,) * 8)]
    assert controller.choose_proposer("v", "", 16, 4, sure, 8)[0] == "draft"
    assert controller.lookups_could_pay(16, 8, "sql", names)  # another route's calibration
    assert controller.lookups_could_pay(1, 8, "", names)  # another batch size's costs
    for _ in range(200):  # verifying got cheap: 0.1 fixed and 0.05 a position
        controller.observe_step(batch=16, k=2.0, seconds=1.2, model=False)
        controller.observe_step(batch=16, k=1.0, seconds=1.15, model=False)
    assert controller.lookups_could_pay(16, 8, "", names)


def least_squares_slope(points: list[tuple[float, float]]) -> float:
    n = len(points)
    mean_k = sum(k for k, _ in points) / n
    mean_t = sum(t for _, t in points) / n
    covariance = sum((k - mean_k) * (t - mean_t) for k, t in points)
    return covariance / sum((k - mean_k) ** 2 for k, _ in points)


def test_a_few_early_looked_up_steps_do_not_set_the_slope_alone():
    # Three noisy steps a fraction of a position apart (15-27 ms on a base of 8): least
    # squares through them prices a position at 15 ms, every lookup out; the prior's
    # pseudo-steps hold the slope until steps of different widths measure it.
    early = [(0.5, 0.0153), (0.9, 0.0274), (1.0, 0.0200)]
    costs = StepCosts()
    for _ in range(5):
        costs.observe(batch=16, k=0, seconds=0.0083)
    for extra, seconds in early:
        costs.observe(batch=16, k=extra, seconds=seconds, model=False)
    assert least_squares_slope(early) > 0.012  # the control: the plain fit's slope
    base, _, slope = costs._free_line(16)
    assert slope < 0.005  # near the prior's (0.24 of the base: 2 ms)
    # Steps over a spread of widths decide: 3 ms fixed and 2 ms a position.
    for _ in range(10):
        for extra in (1.0, 4.0, 8.0):
            costs.observe(batch=16, k=extra, seconds=0.0083 + 0.003 + 0.002 * extra, model=False)
    base, fixed, slope = costs._free_line(16)
    assert slope == pytest.approx(0.002, rel=0.15) and fixed == pytest.approx(0.003, rel=0.3)


def test_every_other_lookup_probe_takes_the_whole_proposal():
    """Probes all at one position a row measure the looked-up cost line's mean, never its
    slope: every other one (the first too) verifies each row's whole proposal."""
    controller = GoodputController(max_k=8)
    for _ in range(5):
        controller.observe_step(batch=16, k=0, seconds=1.0)
    for _ in range(10):  # a line that prices every lookup out: 1 a position a row
        for extra in (1.0, 2.0):
            controller.observe_step(batch=16, k=extra, seconds=1.0 + extra, model=False)
    offer = [("suffix", (0.9,) * 6)]
    assert controller.choose_proposer("v", "", 16, 4, offer, 8)[0] == "draft"
    widths = []
    for _ in range(40 * controller.probe_every):
        probing = controller._probing_lookups()
        name, k = controller.choose_proposer("v", "", 16, 4, offer, 8)
        assert (name == "suffix") == probing
        if probing:
            widths.append((k, controller.batch_width(16, [[1.0] + [1.5] * 6], 15)))
        controller.observe_step(batch=16, k=0, seconds=1.0, emitted=16)
    assert widths[:4] == [(6, 6), (1, 1), (6, 6), (1, 1)]


def test_a_probe_that_gained_spends_none_of_the_exploration_share():
    def next_probe_allowed(emitted: int) -> bool:
        controller = GoodputController(max_k=4)
        for _ in range(200):
            controller.observe_step(batch=16, k=0, seconds=1.0, emitted=16)
        controller._probed = True  # a probe at 3x a step's seconds
        controller.observe_step(batch=16, k=4.0, seconds=3.0, model=False, emitted=emitted)
        return controller._may_explore()

    assert next_probe_allowed(emitted=16 * 4)  # 4x the target alone's tokens: a gain
    assert not next_probe_allowed(emitted=16)  # nothing accepted: 2 steps' seconds lost


def test_drafting_that_pays_is_not_held_off():
    controller = GoodputController(max_k=4, prior=0.9)
    controller.observe_step(batch=16, k=0, seconds=1.0)
    for _ in range(20):  # 1.5x the step for 2x the tokens
        controller.observe_step(batch=16, k=2, seconds=1.5, emitted=32)
    assert not controller.held_off(16)
    # Probe steps are the exploration share's, not the guard's evidence.
    bad = GoodputController(max_k=4, prior=0.9)
    bad.observe_step(batch=16, k=0, seconds=1.0)
    for _ in range(20):
        bad._probed = True
        bad.observe_step(batch=16, k=1, seconds=5.0, emitted=16)
    assert not bad.held_off(16)


@pytest.mark.parametrize("aside", ["riding", "grew"])
def test_a_step_a_prompt_rode_in_or_the_cache_grew_in_is_no_cost_nor_guard_evidence(aside: str):
    # A joining prompt read in the step (osd.decode.loop) makes it dear for no drafting's
    # sake: counted, 16 rows' steps carrying prompts held the demo's drafting off. So does a
    # KV cache's storage growing in it (its layers zeroed and copied).
    controller = GoodputController(max_k=4, prior=0.9)
    controller.observe_step(batch=16, k=0, seconds=1.0)
    costs = controller.costs.seconds(16, 4)
    for _ in range(10):  # a prompt's tokens widen the forward (k > 0) and triple its seconds
        controller.observe_step(batch=16, k=3, seconds=3.0, emitted=17, **{aside: True})
    assert not controller.held_off(16) and controller.costs.seconds(16, 4) == costs
    assert controller.steps == 11
    for _ in range(10):  # the control: the same steps, no prompt in them
        controller.observe_step(batch=16, k=3, seconds=3.0, emitted=17)
    assert controller.held_off(16)


def test_the_guard_judges_only_against_a_measured_step_without_drafting():
    controller = GoodputController(max_k=4, prior=0.9)
    for _ in range(10):  # cold: no step without drafting measured at 16 rows (nor anywhere)
        controller.observe_step(batch=16, k=2, seconds=0.02, emitted=20)
    controller.observe_step(batch=16, k=0, seconds=0.01)
    for _ in range(6):  # 2x the step for 1.25x the tokens: held off, the cold steps unheard
        controller.observe_step(batch=16, k=2, seconds=0.02, emitted=20)
    assert controller.held_off(16)


def test_a_batch_size_whose_drafting_steps_all_catch_up_measures_its_base_and_is_held_off():
    """With 2 clients, the steps of one row between two requests drafted, each after reading
    the tokens the draft had missed: such steps stay out of the cost line, so that batch size
    had neither a line nor a base, kept the prior's cheap drafting, and the realized-gain
    guard (which prices drafting against the batch size's own base) could never judge it."""
    controller = GoodputController(max_k=4, prior=0.9, costs=StepCosts(prior_ratio=0.1))
    for _ in range(40):  # two rows, the target alone: 4 ms a step
        controller.observe_step(batch=2, k=0, seconds=0.004, emitted=2)
    assert controller.choose("v", "", batch=1, limit=8) == 0  # its base first
    controller.observe_step(batch=1, k=0, seconds=0.0035, emitted=1)
    chosen = []
    for _ in range(12):  # each drafting step catches up: 10 ms for 2 tokens (1 in 3.5 ms)
        k = controller.choose("v", "", batch=1, limit=8)
        chosen.append(k)
        accepted = min(k, 1)  # the estimates still favour drafting: only the guard sees it lose
        controller.observe_row("v", "", k, accepted)
        controller.observe_step(batch=1, k=k, seconds=0.010 if k else 0.0035,
                                catching_up=k > 0, emitted=1 + accepted)  # fmt: skip
    assert chosen[0] > 0  # drafting is tried ...
    assert chosen[-4:] == [0, 0, 0, 0]  # ... and held off once it is seen to lose
    assert controller.held_off(1)
