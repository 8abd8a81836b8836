"""The thread chooser: every core alone, an even share when osd's torch processes share them,
an explicit count (config before ``OSD_TORCH_THREADS``) always; PASSIVE unless the user chose."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from osd.threads import (
    ThreadChoice,
    child_env,
    choose_threads,
    ensure_wait_policy,
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
            "OMP_WAIT_POLICY unset (idle workers spin)",
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
        "OMP_WAIT_POLICY": "PASSIVE",
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
    choice = threads_for("trainer", 0, requested_by="trainer.torch_threads")
    assert (choice.num_threads, choice.num_processes, choice.wait_policy) == (2, 2, "PASSIVE")


@pytest.mark.parametrize(
    ("cpu_max", "cores"),
    [("max 100000", None), ("200000 100000", 2), ("150000 100000", 2), ("50000 100000", 1)],
)
def test_cgroup_quota_in_whole_cores(cpu_max, cores):
    assert quota_cores(cpu_max) == cores


def test_wait_policy_is_set_for_children_and_the_users_is_kept(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    # torch is loaded in the test process, so without a command line to re-execute the policy
    # is only in effect for children.
    assert ensure_wait_policy(None) is False
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert ensure_wait_policy(None) is True
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


def test_a_process_that_loaded_torch_first_re_executes_itself_once_with_the_policy():
    # osd/threads.py alone, with a stand-in for torch: fast, and no real OpenMP needed.
    code = (
        "import importlib.util, os, sys\n"
        f"spec = importlib.util.spec_from_file_location('threads', {str(THREADS_PY)!r})\n"
        "threads = sys.modules['threads'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(threads)\n"
        "print('run', os.environ.get('OMP_WAIT_POLICY'), flush=True)\n"
        "sys.modules['torch'] = object()\n"
        "print('in effect', threads.ensure_wait_policy(sys.orig_argv))\n"
    )
    assert importlib.util.find_spec("torch") is not None
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.stdout.splitlines() == ["run None", "run PASSIVE", "in effect True"], done.stderr
