"""``model.cuda_graphs`` (osd.decode.cuda_graphs): the graphed layers, with their padded
batches, indexed slots and masked key columns, compute what the eager in-place layers do
(logits and every slot's keys and values but the trash slot's), capture one graph per bucket
and no more, drop their graphs when the cache grows, hold at most ``max_graphs``, and keep
greedy speculation equal to the target alone.

On the CPU a graph's capture and replay are stood in for by calls of the same function over
the same static buffers (``eager_replay``): everything but the CUDA graph itself runs as it
does on a GPU. Where CUDA is present, the last test runs real graphs.
"""

from __future__ import annotations

import functools

import pytest
import torch

from osd import SpeculativeDecoder
from osd.decode.cuda_graphs import GraphedLayers, bucket_of
from osd.decode.kv_cache import SlotKVCache
from osd.decode.lean_forward import _in_place_layers
from osd.decode.models import CausalLM
from tests.decode.test_compiled_forward import (
    SLOTS,
    _plan,
    assert_greedy_speculation_gives_the_target_alones_tokens,
)
from tests.families import build_family, family_pair


def eager_replay(run, pool):
    """A stand-in for a CUDA graph: the call itself, replayed into the same output tensor."""
    out = run()
    return out, lambda: out.copy_(run())


def graphed(model, max_graphs: int = 64, pools: list | None = None) -> CausalLM:
    """``model``'s CausalLM with its in-place layers graphed through ``eager_replay``; each
    memory pool it asks for is appended to ``pools``."""
    lm = CausalLM(model, 64)
    lean = lm._lean_forward()
    assert lean is not None and not lean.graphed  # on the CPU, cuda_graphs does nothing
    layers = functools.partial(_in_place_layers, lean.layers)
    pools = [] if pools is None else pools
    lean.graphed_layers = GraphedLayers(
        layers,
        recorder=eager_replay,
        max_graphs=max_graphs,
        new_pool=lambda: pools.append(len(pools)) or pools[-1],
    )
    return lm


def _graphs(lm: CausalLM) -> GraphedLayers:
    lean = lm._lean_forward()
    assert lean is not None and lean.graphed_layers is not None
    return lean.graphed_layers


def _mixed_plans(eager: CausalLM) -> list:
    """A prefill of ragged rows, decode steps of 3 rows (a bucket of 4), of rows not in the
    first slots, a verify-shaped step, and rows long enough to need a larger key bucket."""
    return [
        _plan(eager, [9, 5, 7], [0, 0, 0], 0),
        _plan(eager, [1, 1, 1], [9, 5, 7], 1),
        _plan(eager, [4, 4, 4], [10, 6, 8], 2),
        _plan(eager, [6, 2], [0, 0], 3, first=3),
        _plan(eager, [1, 1], [6, 2], 4, first=3),
        _plan(eager, [30, 41], [7, 3], 5, first=3),
        _plan(eager, [1, 1], [37, 44], 6, first=3),
        _plan(eager, [1], [14], 7, first=2),
    ]


def _run_over(models, caches, plans, tolerance: float = 1e-5) -> None:
    """Each plan through every model over its cache; each model's logits equal the first's."""
    with torch.inference_mode():
        for plan in plans:
            width = plan.input_ids.shape[1]
            want, *others = (
                m.run(plan, c, num_logits=width) for m, c in zip(models, caches, strict=True)
            )
            for got in others:
                torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


@pytest.fixture(scope="module")
def model():
    return build_family("llama3", 3)


def test_graphed_layers_compute_what_the_eager_ones_do(model):
    eager, lm = CausalLM(model, 64), graphed(model)
    caches = [SlotKVCache(SLOTS, 160) for _ in range(2)]
    _run_over([eager, lm], caches, _mixed_plans(eager))
    for store in ("_keys", "_values"):  # every slot but the trash slot, padding rows' own
        pairs = zip(getattr(caches[1], store), getattr(caches[0], store), strict=True)
        for mine, theirs in pairs:
            torch.testing.assert_close(mine[:SLOTS], theirs[:SLOTS], rtol=1e-5, atol=1e-5)
    graphs = _graphs(lm)
    # (batch bucket, tokens a row, key bucket): 4x1x32 4x4x32 2x6x32 2x1x32 2x41x64 2x1x64
    # 1x1x32; the first forward runs eagerly (it allocates the cache).
    assert graphs.captures == graphs.graphs == 7


def test_a_bucket_seen_before_replays_without_a_capture(model):
    eager, lm = CausalLM(model, 64), graphed(model)
    caches = [SlotKVCache(SLOTS, 160) for _ in range(2)]
    _run_over([eager, lm], caches, _mixed_plans(eager))
    captures = _graphs(lm).captures
    # Other sizes in the same buckets: 3 rows -> 4, 4 -> 4, contexts within 32.
    plans = [
        _plan(eager, [8, 2, 5], [0, 0, 0], 8),  # 4x8: a new width, captured
        _plan(eager, [1, 1, 1], [8, 2, 5], 9),
        _plan(eager, [4, 4, 4], [9, 3, 6], 10),
        _plan(eager, [1, 1, 1, 1], [13, 7, 10, 0], 11),
    ]
    _run_over([eager, lm], caches, plans)
    assert _graphs(lm).captures == captures + 1


def test_graphs_are_dropped_when_the_cache_grows(model):
    pools: list[int] = []
    eager, lm = CausalLM(model, 64), graphed(model, pools=pools)
    caches = [SlotKVCache(SLOTS, 160) for _ in range(2)]  # 64 positions at first: grows below
    plans = [_plan(eager, [5, 3], [0, 0], 12), _plan(eager, [1, 1], [5, 3], 13)]
    plans += [_plan(eager, [90, 1], [6, 4], 14), _plan(eager, [1, 1], [96, 5], 15)]
    _run_over([eager, lm], caches, plans)
    graphs = _graphs(lm)
    assert caches[1]._keys[0].shape[1] > 64  # it grew
    assert graphs.captures == 3 and graphs.graphs == 2  # the one before it grew is gone
    assert pools == [0, 1]  # the graphs after it in a pool of their own (torch asserts else)


@pytest.mark.parametrize("max_graphs", [1, 2])
def test_at_most_max_graphs_are_held(model, max_graphs):
    pools: list[int] = []
    eager, lm = CausalLM(model, 64), graphed(model, max_graphs=max_graphs, pools=pools)
    _run_over([eager, lm], [SlotKVCache(SLOTS, 160) for _ in range(2)], _mixed_plans(eager))
    assert _graphs(lm).graphs == max_graphs and _graphs(lm).captures == 7
    # One graph held: each capture drops the only other, so each takes a new pool.
    assert len(pools) == (7 if max_graphs == 1 else 1)


def test_buckets():
    assert [bucket_of(n) for n in (1, 2, 3, 4, 5, 16, 17)] == [1, 2, 4, 4, 8, 16, 32]
    assert [bucket_of(n, 32) for n in (1, 32, 33)] == [32, 32, 64]


def test_greedy_speculation_gives_the_target_alones_tokens_when_graphed():
    target, draft = family_pair("llama3", 4)
    decoder = SpeculativeDecoder(target, draft, None, max_spec_tokens=4)
    lean = decoder.target._lean_forward()
    assert lean is not None
    layers = functools.partial(_in_place_layers, lean.layers)
    lean.graphed_layers = GraphedLayers(layers, recorder=eager_replay, new_pool=lambda: None)
    assert_greedy_speculation_gives_the_target_alones_tokens(decoder)
    assert lean.graphed_layers.captures > 0


def test_the_switch_reaches_both_models():
    target, draft = family_pair("llama3", 4)
    decoder = SpeculativeDecoder(target, draft, None, cuda_graphs=True)
    assert decoder.target.cuda_graphs and decoder.draft.cuda_graphs
    assert not SpeculativeDecoder(target, draft, None).target.cuda_graphs  # off by default


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real CUDA graphs need a GPU")
def test_real_cuda_graphs_compute_what_the_eager_ones_do():
    model = build_family("llama3", 3).to("cuda")
    eager, lm = CausalLM(model, 64), CausalLM(model, 64, cuda_graphs=True)
    assert lm._lean_forward().graphed
    plans = [_to(plan, "cuda") for plan in _mixed_plans(eager)]
    _run_over([eager, lm], [SlotKVCache(SLOTS, 160) for _ in range(2)], plans, 1e-4)
    assert _graphs(lm).captures == 7


def _to(plan, device: str):
    """``plan``'s tensors on ``device``."""
    import dataclasses

    moved = {
        f.name: getattr(plan, f.name).to(device)
        for f in dataclasses.fields(plan)
        if isinstance(getattr(plan, f.name), torch.Tensor)
    }
    return dataclasses.replace(plan, **moved)


def test_a_failed_capture_runs_the_forward_ungraphed(model):
    def failing(run, pool):
        run()  # the warm-up call, as the CUDA recorder makes it
        raise RuntimeError("operation not permitted when stream is capturing")

    eager, lm = CausalLM(model, 64), graphed(model)
    _graphs(lm)._record = failing
    plans = _mixed_plans(eager)
    _run_over([eager, lm], [SlotKVCache(SLOTS, 160) for _ in range(2)], plans + plans[1:3])
    graphs = _graphs(lm)
    assert graphs.captures == 0 and graphs.graphs == 0
    assert graphs.capture_failures == 7  # each bucket tried once, then run ungraphed
