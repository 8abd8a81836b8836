"""Shared fixtures: tiny randomly initialised Hugging Face models built in code (no downloads),
and the session's one local Ray with Serve's HTTP proxy (every test that deploys a Serve app
deploys it there, under its own route prefix: tests/serving/conftest.py's ``serve_app``)."""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator

import pytest
import torch

from osd.decode.models import CausalLM
from osd.testing import char_tokenizer, noisy_copy, tiny_llama, with_lora_adapters

# Tiny models run fastest single-threaded; the CI machine has two cores.
torch.set_num_threads(1)
# model.compile is on by default: every replica a test starts (in process or in a subprocess
# such as ``osd up``, which inherits this) would compile its graphs first, a minute and more
# on two cores. The suite runs the eager forward unless a test asks for compiling (or
# OSD_TEST_COMPILE=1 below, or this variable set by the caller).
os.environ.setdefault("OSD_MODEL_COMPILE", "0")

# Switches that run the suites over another path than CI's (runs of their own, on chosen
# suites; every model then compiles or captures its own graphs):
# - OSD_TEST_COMPILE=1: every CausalLM with ``model.compile`` on (docs/batched_engine.md,
#   "Compiled layers");
# - OSD_TEST_DEVICE=cuda: every CausalLM wraps a copy of its model on that device (the tests'
#   own references, exact distributions and plain forwards, stay on the CPU models);
# - OSD_TEST_CUDA_GRAPHS=1: every CausalLM with ``model.cuda_graphs`` on (scripts/gpu_check.sh).
_TEST_COMPILE = os.environ.get("OSD_TEST_COMPILE") == "1"
_TEST_DEVICE = os.environ.get("OSD_TEST_DEVICE")
_TEST_CUDA_GRAPHS = os.environ.get("OSD_TEST_CUDA_GRAPHS") == "1"
if _TEST_COMPILE or _TEST_DEVICE or _TEST_CUDA_GRAPHS:
    _plain_post_init = CausalLM.__post_init__

    def _switched_post_init(self: CausalLM) -> None:
        if _TEST_DEVICE and self.model.device.type != torch.device(_TEST_DEVICE).type:
            self.model = copy.deepcopy(self.model).to(_TEST_DEVICE)
        self.compile = self.compile or _TEST_COMPILE
        self.cuda_graphs = self.cuda_graphs or _TEST_CUDA_GRAPHS
        _plain_post_init(self)

    CausalLM.__post_init__ = _switched_post_init  # type: ignore[method-assign]


def pytest_report_header() -> list[str]:
    lines = []
    if _TEST_COMPILE:
        lines.append("OSD_TEST_COMPILE=1: every CausalLM compiled (model.compile)")
    if _TEST_DEVICE:
        lines.append(f"OSD_TEST_DEVICE={_TEST_DEVICE}: every CausalLM's model copied there")
    if _TEST_CUDA_GRAPHS:
        lines.append("OSD_TEST_CUDA_GRAPHS=1: every CausalLM with model.cuda_graphs on")
    return lines


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    from osd.decode.compiled_forward import compile_stats

    stats = compile_stats()
    if _TEST_COMPILE:
        terminalreporter.write_line(
            f"OSD_TEST_COMPILE=1: {stats.compilations} graphs compiled in {stats.seconds:.0f} s"
        )
    if _TEST_CUDA_GRAPHS:
        terminalreporter.write_line(f"OSD_TEST_CUDA_GRAPHS=1: {stats.captures} graphs captured")


@pytest.fixture(scope="session")
def tokenizer():
    return char_tokenizer()


@pytest.fixture(scope="session")
def target_model():
    """Vocab 64 target, peaked enough that greedy decoding has clear winners."""
    return tiny_llama(vocab_size=64, hidden_size=48, num_layers=2, seed=1, logit_scale=4.0)


@pytest.fixture(scope="session")
def lora_draft(target_model):
    """A draft close to the target (so drafts are often accepted) with two LoRA adapters."""
    return with_lora_adapters(noisy_copy(target_model, 0.3, seed=2), ["code", "sql"], seed=3)


@pytest.fixture(scope="session")
def unrelated_draft():
    """A draft unrelated to the target: almost everything is rejected."""
    return tiny_llama(vocab_size=64, hidden_size=32, num_layers=1, seed=4, logit_scale=4.0)


def _start_serve(serve, free_port, tries: int = 3) -> int:
    """Serve's HTTP proxy on a free port; another port if that one was taken before the proxy
    bound it (CI: "Failed to bind to address" for a port ``bind(0)`` had handed out while Ray
    was opening its own connections from the same range)."""
    for _ in range(tries - 1):
        port = free_port()
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            return port
        except Exception:  # noqa: BLE001 - another port; the last try raises
            with contextlib.suppress(Exception):
                serve.shutdown()
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return port


@pytest.fixture(scope="session")
def serve_port() -> Iterator[int]:
    """A local Ray with Serve's HTTP proxy on a free port (the port); apps come and go on it."""
    import ray
    from ray import serve

    from launcher.stack import free_port

    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},
    )
    try:
        yield _start_serve(serve, free_port)
    finally:
        # Serve's own shutdown sometimes finds its proxy already gone on a loaded machine; that
        # is Ray's business, not a test's: Ray goes down whatever it says.
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
