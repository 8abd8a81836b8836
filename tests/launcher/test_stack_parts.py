"""The parts of launcher.stack that need no Ray: the port a stack serves on, the config file
the trainer child reads back, the signal handlers ``osd up`` installs, ``close()`` on a
stack that never started, and waiting for the replica and the trainer's first heartbeat. The
stack itself, started and stopped, is ``test_stack.py``."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from launcher.stack import LocalStack, config_to_yaml, free_port, install_signal_handlers
from osd.buffer.loop_status import TrainerBeat, trainer_beat_key, write_beat
from osd.buffer.redis_server import LocalRedis, connect
from osd.config import OSDConfig, load_config
from tests.serving.conftest import TOY

HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@pytest.fixture
def saved_signal_handlers() -> Iterator[None]:
    """The handlers as they were, put back after the test (they are the process's own)."""
    saved = {sig: signal.getsignal(sig) for sig in HANDLED}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def toy_config(*overrides: str) -> OSDConfig:
    return load_config(None, [*TOY, "serve.port=8123", *overrides])


def test_the_port_argument_overrides_the_configs():
    config = toy_config()
    assert LocalStack(config).config.serve.port == 8123  # 0: the config's
    chosen = LocalStack(config, port=9001)
    assert chosen.config.serve.port == 9001
    assert chosen.base_url == f"http://{config.serve.host}:9001"
    # Nothing else changes, and the caller's config is left as it was.
    assert dataclasses.replace(chosen.config.serve, port=8123) == config.serve
    assert chosen.config.run_dir == config.run_dir and config.serve.port == 8123


def test_port_minus_one_serves_on_a_free_port():
    stack = LocalStack(toy_config(), port=-1)
    port = stack.config.serve.port
    assert port not in (-1, 0, 8123)
    assert stack.base_url.endswith(f":{port}")


def test_the_run_dir_is_resolved_to_an_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    stack = LocalStack(toy_config("run_dir=runs/here"))
    assert stack.run_dir == tmp_path / "runs" / "here"


@pytest.mark.parametrize(
    "overrides",
    [
        (),
        ("model.adapters=[general,code,chat]", "serve.max_ongoing_requests=3", "log.max_bytes=5"),
    ],
)
def test_the_config_file_written_for_the_trainer_loads_back_as_the_same_config(tmp_path, overrides):
    config = toy_config(*overrides)
    path = tmp_path / "config.yaml"
    path.write_text(config_to_yaml(config))
    assert load_config(str(path)) == config


def test_close_on_a_stack_that_never_started_is_safe_to_repeat(tmp_path, saved_signal_handlers):
    sentinel = signal.getsignal(signal.SIGINT)
    stack = LocalStack(toy_config(f"run_dir={tmp_path / 'run'}"))
    with stack:
        assert stack.supervision() == {}  # nothing supervised before start()
    stack.close()
    stack.close()
    assert stack.supervision() == {}
    assert stack.redis is None and stack.trainer is None
    # close() ignores Ctrl-C only while it stops things, and gives the handler back.
    assert signal.getsignal(signal.SIGINT) is sentinel


@pytest.mark.parametrize("sig", HANDLED)
def test_installed_handlers_turn_a_stop_signal_into_keyboard_interrupt(sig, saved_signal_handlers):
    # Started in the background by a non-interactive shell, SIGINT is inherited ignored.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    install_signal_handlers()
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), sig)


def test_a_stack_that_never_answers_times_out_naming_its_url():
    stack = LocalStack(toy_config(), port=free_port())  # nothing listens there
    with pytest.raises(TimeoutError, match=stack.base_url):
        stack.wait_ready(timeout_s=0.5)


def test_waiting_for_the_replica_hears_ctrl_c_and_a_failed_deployment(monkeypatch):
    """The replica's warm-up (minutes when it compiles) is waited for outside Serve's own
    blocking deploy: Ctrl-C ends the wait at once, and a deployment Serve gave up on ends it
    with Serve's message (here Serve's status stands in: a real failed deployment takes Ray
    and several failed replica starts)."""
    from ray import serve

    stack = LocalStack(toy_config(), port=free_port())  # nothing listens there
    with pytest.raises(KeyboardInterrupt):
        stack.wait_ready(timeout_s=30, interrupted=lambda: True)
    failed = SimpleNamespace(status="DEPLOY_FAILED", message="replica constructor raised")
    status = SimpleNamespace(applications={"osd": failed})
    monkeypatch.setattr(serve, "status", lambda: status)
    stack._ray_started = True
    with pytest.raises(RuntimeError, match="replica constructor raised"):
        stack.wait_ready(timeout_s=30)


def test_waiting_for_the_trainer_ends_at_its_first_heartbeat_or_the_timeout():
    """The demo sends traffic once the trainer consumes (`LocalStack.wait_trainer`): a real
    redis-server, a child standing in for the trainer, and the heartbeat it would write."""
    config = toy_config()
    with LocalRedis() as server:
        stack = LocalStack(config)
        stack.redis_url = server.url
        assert not stack.wait_trainer(timeout_s=0.2)  # no trainer started: nothing to wait for
        stack.trainer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            started = time.monotonic()
            assert not stack.wait_trainer(timeout_s=1.0)  # started, never beat
            assert time.monotonic() - started >= 1.0
            key = trainer_beat_key(config.log.stream, config.trainer.group)
            write_beat(connect(server.url), key, TrainerBeat(1, time.time(), 0.0, 0.0, 0, 0.0))
            assert stack.wait_trainer(timeout_s=5.0)
        finally:
            stack.trainer.kill()
            stack.trainer.wait()
