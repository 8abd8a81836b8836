"""The thread chooser: every core alone, an even share when osd's torch processes share them,
an explicit count (config before ``OSD_TORCH_THREADS``) always; the user's wait policy passed on;
and the tuner that moves a training loop to the faster thread count by measuring."""

from __future__ import annotations

from pathlib import Path

import pytest

from osd.threads import (
    ThreadChoice,
    ThreadTuner,
    child_env,
    choose_threads,
    quota_cores,
    threads_for,
)

THREADS_PY = Path(__file__).resolve().parents[1] / "osd" / "threads.py"


@pytest.mark.parametrize(
    ("num_cores", "num_processes", "expected"),
    [
        (2, 1, 2),  # alone: all cores (356 ms a step against 631 ms with 1 thread)
        (2, 2, 1),  # replica + trainer on 2 cores: no oversubscription
        (16, 2, 8),
        (3, 2, 1),  # never more threads than cores in all
        (1, 3, 1),  # at least one
    ],
)
def test_automatic_count_splits_the_usable_cores_among_the_torch_processes(
    num_cores, num_processes, expected
):
    choice = choose_threads("trainer", num_cores=num_cores, num_processes=num_processes)
    assert (choice.num_threads, choice.source) == (expected, "auto")


@pytest.mark.parametrize(
    ("num_cores", "num_processes", "expected"),
    [(2, 1, 1), (2, 2, 1), (16, 1, 15), (16, 2, 7), (1, 1, 1)],
)
def test_a_replica_leaves_a_core_of_its_share_to_its_http_side(num_cores, num_processes, expected):
    choice = choose_threads("replica", num_cores=num_cores, num_processes=num_processes)
    assert (choice.num_threads, choice.source) == (expected, "auto")


def test_environment_override_beats_the_automatic_choice():
    choice = choose_threads("build", num_cores=8, num_processes=2, env={"OSD_TORCH_THREADS": "3"})
    assert (choice.num_threads, choice.source) == (3, "OSD_TORCH_THREADS")


def test_config_override_beats_the_environment():
    choice = choose_threads(
        "replica",
        4,
        num_cores=2,
        env={"OSD_TORCH_THREADS": "1"},
        requested_by="serve.torch_threads",
    )
    assert (choice.num_threads, choice.source) == (4, "serve.torch_threads")


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_malformed_environment_count_names_the_variable(value):
    with pytest.raises(ValueError, match=f"OSD_TORCH_THREADS .*{value!r}"):
        choose_threads("bench", num_cores=2, env={"OSD_TORCH_THREADS": value})


def test_bad_arguments_are_refused_with_the_value():
    with pytest.raises(ValueError, match="trainer.torch_threads must be >= 0.*-2"):
        choose_threads("trainer", -2, num_cores=2, requested_by="trainer.torch_threads")
    with pytest.raises(ValueError, match="role"):
        choose_threads("decoder", num_cores=2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_processes"):
        child_env(0)


@pytest.mark.parametrize(
    ("choice", "line"),
    [
        (
            ThreadChoice("trainer", 1, 2, 2, "auto", "PASSIVE"),
            "torch (trainer): 1 thread of 2 usable cores (shared by 2 torch processes), "
            "OMP_WAIT_POLICY=PASSIVE",
        ),
        (
            ThreadChoice("build", 2, 2, 1, "auto", ""),
            "torch (build): 2 threads of 2 usable cores (alone), "
            "OMP_WAIT_POLICY unset (OpenMP's default)",
        ),
        (
            ThreadChoice("replica", 4, 1, 1, "serve.torch_threads", "ACTIVE"),
            "torch (replica): 4 threads of 1 usable core (set by serve.torch_threads), "
            "OMP_WAIT_POLICY=ACTIVE",
        ),
    ],
)
def test_describe_says_what_was_chosen_and_why(choice, line):
    assert choice.describe() == line


def test_child_env_shares_the_cores_and_keeps_the_users_choices():
    assert child_env(2, {}) == {
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OSD_TORCH_PROCESSES": "2",
    }
    mine = child_env(2, {"OMP_WAIT_POLICY": "ACTIVE", "OSD_TORCH_THREADS": "4"})
    assert mine["OMP_WAIT_POLICY"] == "ACTIVE" and mine["OSD_TORCH_THREADS"] == "4"


def test_a_child_of_the_stack_takes_its_share(monkeypatch):
    monkeypatch.setattr("osd.threads.usable_cores", lambda: 4)
    for name, value in child_env(2, {}).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("OSD_TORCH_THREADS", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    choice = threads_for("trainer", 0, requested_by="trainer.torch_threads")
    assert (choice.num_threads, choice.num_processes, choice.wait_policy) == (2, 2, "")


@pytest.mark.parametrize(
    ("cpu_max", "cores"),
    [("max 100000", None), ("200000 100000", 2), ("150000 100000", 2), ("50000 100000", 1)],
)
def test_cgroup_quota_in_whole_cores(cpu_max, cores):
    assert quota_cores(cpu_max) == cores


class Machine:
    """Step times that depend on the thread count and on whether a neighbour is busy."""

    def __init__(self, alone: dict[int, float], busy: dict[int, float]) -> None:
        self.times, self.busy, self.threads = {False: alone, True: busy}, False, 0

    def set(self, threads: int) -> None:
        self.threads = threads

    def step(self) -> float:
        return self.times[self.busy][self.threads]


def run(tuner: ThreadTuner, machine: Machine, steps: int) -> list[int]:
    used = []
    for _ in range(steps):
        tuner.before_step()
        used.append(machine.threads)
        tuner.after_step(machine.step())
    return used


def test_tuner_moves_to_one_thread_while_a_neighbour_is_busy_and_back_when_it_leaves():
    # The measured step times of the demo target on 2 cores (osd.threads' docstring).
    machine = Machine(alone={2: 0.35, 1: 0.62}, busy={2: 1.3, 1: 0.92})
    switches = []
    tuner = ThreadTuner(
        (2, 1), set_threads=machine.set, on_switch=lambda *a: switches.append(a), probe_every=8
    )
    alone = run(tuner, machine, 100)
    assert alone[:8] == [2] * 8 and alone.count(1) <= 2 * 4  # probes only, rarer each time
    machine.busy = True
    busy = run(tuner, machine, 100)
    assert busy[-50:].count(1) >= 46 and switches[0][:2] == (2, 1)
    machine.busy = False
    back = run(tuner, machine, 300)
    assert back[-50:].count(2) >= 46 and switches[-1][:2] == (1, 2)


def test_tuner_with_one_count_never_probes():
    machine = Machine(alone={1: 0.5}, busy={1: 0.5})
    tuner = ThreadTuner((1, 1), set_threads=machine.set, probe_every=1)
    assert run(tuner, machine, 20) == [1] * 20


def test_tuner_reacts_within_steps_when_a_neighbour_comes_and_goes():
    """A slow-down (or speed-up) of twice the recent median, two steps in a row, probes at
    once, even when losing probes had pushed the next scheduled one hundreds of steps away."""
    machine = Machine(alone={2: 0.35, 1: 0.62}, busy={2: 10.0, 1: 0.92})
    tuner = ThreadTuner((2, 1), set_threads=machine.set, probe_every=64, max_every=1024)
    run(tuner, machine, 700)  # alone: probes lose, the wait grows to 256 and more
    assert tuner._wait >= 256
    machine.busy = True
    busy = run(tuner, machine, 8)
    assert busy[:2] == [2, 2] and busy[-3:] == [1, 1, 1]  # two slow steps, a probe, switched
    machine.busy = False  # 1 thread gets only 1.5x faster: the scheduled probe brings 2 back
    back = run(tuner, machine, 70)
    assert back[-3:] == [2, 2, 2]


def test_tuner_ignores_single_slow_steps():
    machine = Machine(alone={2: 0.35, 1: 0.62}, busy={2: 10.0, 1: 0.92})
    tuner = ThreadTuner((2, 1), set_threads=machine.set, probe_every=1000)
    used = run(tuner, machine, 20)
    for _ in range(5):  # one slow step now and then (a checkpoint, a GC pause)
        machine.busy = True
        used += run(tuner, machine, 1)
        machine.busy = False
        used += run(tuner, machine, 10)
    assert set(used) == {2}


@pytest.mark.parametrize(("milliseconds", "expected"), [(0.5, 0.0005), (2.0, 0.002), (0.0, None)])
def test_switch_interval_is_set_in_milliseconds_and_zero_leaves_pythons(milliseconds, expected):
    import sys

    from osd.threads import set_switch_interval

    before = sys.getswitchinterval()
    try:
        in_effect = set_switch_interval(milliseconds)
        assert in_effect == pytest.approx(expected if expected is not None else before)
        assert sys.getswitchinterval() == pytest.approx(in_effect)
    finally:
        sys.setswitchinterval(before)


@pytest.mark.parametrize("milliseconds", [-1.0, 101.0, float("nan")])
def test_a_switch_interval_out_of_range_is_refused(milliseconds):
    from osd.config import ServeConfig

    with pytest.raises(ValueError, match="serve.gil_switch_interval_ms"):
        ServeConfig(gil_switch_interval_ms=milliseconds)
