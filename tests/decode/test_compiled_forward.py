"""``model.compile`` (osd.decode.compiled_forward): the in-place decoder layers through
torch.compile compute what the eager lean forward computes (logits and the keys and values
they cache), a changing batch mix does not recompile, and greedy speculation still gives
exactly the target alone's tokens.

One compiled model for the module: graphs are compiled once (seconds each on 2 cores), and
torch caps the graphs of one compiled function in a process.
"""

from __future__ import annotations

import pytest
import torch

from osd import SpeculativeDecoder
from osd.decode import compiled_forward
from osd.decode.compiled_forward import compile_stats, persistent_inductor_cache
from osd.decode.kv_cache import SlotKVCache, packing, plan_forward
from osd.decode.models import CausalLM
from osd.toy_models import with_lora_adapters
from tests.families import build_family, family_pair

SLOTS = 6


@pytest.fixture(scope="module")
def models() -> tuple[CausalLM, CausalLM]:
    """(eager, compiled) lean forwards of one tiny Llama, of two layers (each layer's cache
    reads and writes its own; a third only costs compile time)."""
    model = build_family("llama3", 3, num_hidden_layers=2)
    compiled = CausalLM(model, 64, compile=True)
    compiled_forward._inputs_guards = _recording(compiled_forward._inputs_guards)
    assert compiled._lean_forward() is not None and compiled._lean_forward().compiled
    return CausalLM(model, 64), compiled


_GUARDS: list[tuple[str, bool]] = []  # (guard's source, kept) of every graph compiled


def _recording(keep):
    def record(entries):
        kept = keep(entries)
        _GUARDS.extend((entry.name, k) for entry, k in zip(entries, kept, strict=True))
        return kept

    return record


def _plan(
    lm: CausalLM,
    lengths: list[int],
    start: list[int],
    seed: int,
    first: int = 0,
    packed: bool = False,
    narrow: int = 0,
):
    """Rows in slots ``first``.. reading their own slot in place, ``lengths[b]`` new tokens
    each; ``packed``: only those computed (kv_cache.packing, its attention split as ``narrow``
    says), logits for every column."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(1, 60, (len(lengths), width), generator=gen)
    left = [width - n for n in lengths]
    column = lambda values: torch.tensor(values, dtype=torch.int64)  # noqa: E731
    rows = list(range(first, first + len(lengths)))
    return plan_forward(
        input_ids=ids,
        start=column(start),
        left=column(left),
        real=column(lengths),
        own_slot=column(rows),
        base_slot=column(rows),
        prefix_len=column([0] * len(rows)),
        trash_slot=SLOTS,
        dtype=torch.float32,
        layout=lm.attention,
        first_slot=first,
        packed=(
            packing(left, lengths, width, width, "cpu", share=1.0, narrow=narrow)
            if packed
            else None
        ),
    )


def _run(models, plans):
    """Each plan through every forward, each over its own cache: the logits of each plan
    (eager first), and the caches."""
    caches = [SlotKVCache(SLOTS, 160) for _ in models]
    outs = []
    with torch.inference_mode():
        for plan in plans:
            width = plan.input_ids.shape[1]
            runs = zip(models, caches, strict=True)
            outs.append([lm.run(plan, cache, num_logits=width) for lm, cache in runs])
    return outs, caches


def test_compiled_layers_compute_what_the_eager_ones_do(models):
    before = compile_stats().compilations
    eager = models[0]
    # A prefill of ragged rows, then decode steps of one token a row, then a verify-shaped
    # step of several: the four graphs (one row and several, one token a row and several).
    plans = [
        _plan(eager, [9, 5], [0, 0], 0),
        _plan(eager, [1, 1], [9, 5], 1),
        _plan(eager, [4, 4], [10, 6], 2),
        _plan(eager, [6], [0], 3),
        _plan(eager, [1], [6], 4),
    ]
    outs, caches = _run(models, plans)
    assert compile_stats().compilations > before  # the compiled path ran
    for want, got in outs:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for mine, theirs in zip(caches[1]._keys, caches[0]._keys, strict=True):
        torch.testing.assert_close(mine[:SLOTS], theirs[:SLOTS], rtol=1e-5, atol=1e-5)
    for mine, theirs in zip(caches[1]._values, caches[0]._values, strict=True):
        torch.testing.assert_close(mine[:SLOTS], theirs[:SLOTS], rtol=1e-5, atol=1e-5)


def test_a_changing_batch_mix_does_not_recompile(models):
    eager = models[0]
    _run(models, [_plan(eager, [7, 3], [0, 0], 5), _plan(eager, [1, 1], [7, 3], 6)])
    _run(models, [_plan(eager, [3, 3], [0, 0], 7), _plan(eager, [1], [0], 7)])
    _run(models, [_plan(eager, [2], [0], 7), _plan(eager, [3, 3], [2, 0], 7)])
    # Rows wider than attention by products takes (prefills): SDPA's graphs, one row and
    # several (after a first forward: a row filling the new storage exactly runs eagerly).
    _run(models, [_plan(eager, [4, 4], [0, 0], 7), _plan(eager, [20, 5], [4, 4], 7)])
    _run(models, [_plan(eager, [2], [0], 7), _plan(eager, [18], [2], 7)])
    warm = compile_stats().compilations
    # Other batch sizes, contexts, tokens a row, and a cache that grows past its capacity.
    outs, _ = _run(
        models,
        [
            _plan(eager, [12, 3, 8, 5], [0, 0, 0, 0], 8),
            _plan(eager, [1, 1, 1, 1], [12, 3, 8, 5], 9),
            _plan(eager, [3, 2, 5, 1], [13, 4, 9, 6], 10),
            _plan(eager, [40, 100, 2], [0, 0, 0], 11),
            _plan(eager, [1, 1, 1], [40, 100, 2], 12),
            _plan(eager, [1] * 5, [0] * 5, 13),
        ],
    )
    # The longest row reaching the storage's capacity (64) exactly, then passing it: torch
    # guards on keys read as the whole storage, so that step must not be a graph of its own.
    outs += _run(
        models,
        [
            _plan(eager, [60, 20], [0, 0], 14),
            _plan(eager, [3, 3], [60, 20], 15),
            _plan(eager, [1, 1], [63, 23], 16),
            _plan(eager, [1, 1], [64, 24], 17),
        ],
    )[0]
    # Rows from other first slots (the decode loop's rows move as requests come and go): the
    # same graphs, the same outputs.
    for first in (1, 3):
        outs += _run(
            models,
            [
                _plan(eager, [6, 2], [0, 0], 20 + first, first=first),
                _plan(eager, [1, 1], [6, 2], 21 + first, first=first),
                _plan(eager, [3, 3], [7, 3], 22 + first, first=first),
            ],
        )[0]
    assert compile_stats().compilations == warm
    for want, got in outs:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_packed_verify_steps_run_their_own_graph_for_any_mix_of_rows_and_widths(models):
    # Rows verifying different numbers of drafted tokens compute only their real tokens
    # (kv_cache.packing): a graph of its own, compiled once, then any mix runs it, computing
    # what the eager forward does (which runs the plan through the cache's own reads).
    eager, compiled = models
    layers = compiled._lean_forward().in_place_layers.func
    warm_up = [
        _plan(eager, [9, 5, 7], [0, 0, 0], 30),
        _plan(eager, [5, 1, 3], [9, 5, 7], 31, packed=True),
    ]
    _run(models, warm_up)
    assert any(packed for _, _, packed in layers._times)  # the packed graph ran
    warm = compile_stats().compilations
    outs, caches = _run(
        models,
        [
            _plan(eager, [12, 3, 8, 5], [0] * 4, 32),
            _plan(eager, [9, 1, 1, 4], [12, 3, 8, 5], 33, packed=True),
            _plan(eager, [1, 6, 2, 1], [21, 4, 9, 9], 34, packed=True),
            _plan(eager, [2, 1, 1, 1], [22, 10, 11, 10], 35, packed=True),
        ],
    )
    outs += _run(
        models,
        [
            _plan(eager, [4, 4], [0, 0], 36, first=2),
            _plan(eager, [1, 5], [4, 4], 37, first=2, packed=True),
        ],
    )[0]
    assert compile_stats().compilations == warm
    for want, got in outs:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for mine, theirs in zip(caches[1]._keys, caches[0]._keys, strict=True):
        torch.testing.assert_close(mine[:SLOTS], theirs[:SLOTS], rtol=1e-5, atol=1e-5)


def test_a_prompt_read_in_a_decode_step_runs_one_graph_for_any_prompt_and_rows(models):
    # A joining prompt riding in the step of rows decoding or verifying a few tokens
    # (osd.decode.loop): attention on two grids (kv_cache.attention_split), one graph for any
    # prompt length, rows and widths, computing what the eager forward does.
    eager, compiled = models
    warm_up = [
        _plan(eager, [9, 5, 7, 3], [0] * 4, 50),
        _plan(eager, [1, 1, 1, 20], [9, 5, 7, 3], 51, packed=True, narrow=16),
    ]
    before = compile_stats().compilations
    _run(models, warm_up)
    assert compile_stats().compilations > before
    layers = compiled._lean_forward().in_place_layers.func
    assert any(tokens == 3 and packed for _, tokens, packed in layers._times)  # its graph ran
    warm = compile_stats().compilations
    plans = [
        _plan(eager, [12, 3, 8, 5, 2], [0] * 5, 52),
        _plan(eager, [1, 1, 1, 1, 30], [12, 3, 8, 5, 2], 53, packed=True, narrow=16),
        _plan(eager, [3, 1, 4, 23, 2], [13, 4, 9, 6, 32], 54, packed=True, narrow=16),
        _plan(eager, [2, 2, 40], [16, 5, 13], 55, packed=True, narrow=16),
    ]
    for plan in plans[1:]:
        assert plan.packed is not None and plan.packed.split is not None
        assert len(plan.packed.split.wide) == 1
    outs, caches = _run(models, plans)
    assert compile_stats().compilations == warm
    for want, got in outs:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for mine, theirs in zip(caches[1]._keys, caches[0]._keys, strict=True):
        torch.testing.assert_close(mine[:SLOTS], theirs[:SLOTS], rtol=1e-5, atol=1e-5)


def test_after_compile_graphs_no_served_shape_compiles():
    # The warm-up runs compile_graphs on both models: served, a draft back on 16 rows after
    # steps without it read a few tokens a row, all rows alike, a graph the warm-up's requests
    # had not reached, and it compiled on the first concurrent requests (4.5 s from inductor's
    # cache). A model of its own: the module's other models compiled their graphs already.
    # One layer: compiling nine graphs of three took 93 s of the suite on 2 cores.
    model = build_family("llama3", 5, num_hidden_layers=1)
    eager, compiled = CausalLM(model, 64), CausalLM(model, 64, compile=True)
    models = (eager, compiled)
    assert eager.compile_graphs() == 0
    before = compile_stats().compilations
    # One row or several x one, a few, many tokens a row; packed: a verify step's rows of
    # different widths, attending on the whole grid or split (several wide rows), a prompt
    # read in a decode step (one wide row).
    assert compiled.compile_graphs() == 9
    assert compile_stats().compilations > before  # they compiled here, not earlier
    warm = compile_stats().compilations
    with torch.inference_mode():  # planned as the decode loop's steps plan (dynamo guards on it)
        five_rows = [
            _plan(eager, [30] * 5, [0] * 5, 40),
            _plan(eager, [14] * 5, [30] * 5, 41),
            _plan(eager, [1] * 5, [44] * 5, 42),
            _plan(eager, [3, 9, 1, 1, 2], [45] * 5, 43, packed=True),
            _plan(eager, [1, 1, 26, 1, 1], [54] * 5, 47, packed=True, narrow=16),
            # Verify steps, right-aligned (forward.right_aligned): looked-up drafts beside
            # rows of one token, their attention split with one wide row and with two.
            _plan(eager, [1, 1, 9, 1, 1], [57] * 5, 48, packed=True, narrow=16),
            _plan(eager, [9, 1, 7, 1, 1], [66] * 5, 49, packed=True, narrow=16),
        ]
        assert [len(plan.packed.split.wide) for plan in five_rows[-2:]] == [1, 2]
        one_row = [_plan(eager, [20], [0], 44), _plan(eager, [1], [20], 45)]
        one_row.append(_plan(eager, [6], [21], 46))
    outs = _run(models, five_rows)[0] + _run(models, one_row)[0]
    assert compile_stats().compilations == warm
    for want, got in outs:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_stores_are_marked_dynamic_again_when_the_cache_grows(models):
    # Marks stay with their tensors, so a step marks the stores only when they are new: the
    # grown cache's stores must be marked too, or the next compilation would specialize them.
    compiled, eager = models[1], models[0]
    cache = SlotKVCache(SLOTS, 160)
    with torch.inference_mode():
        compiled.run(_plan(eager, [6, 2], [0, 0], 30), cache, num_logits=1)
        compiled.run(_plan(eager, [1, 1], [6, 2], 31), cache, num_logits=1)
        before = [*cache._keys, *cache._values]
        compiled.run(_plan(eager, [70, 3], [7, 3], 32), cache, num_logits=1)
        compiled.run(_plan(eager, [1, 1], [77, 6], 33), cache, num_logits=1)
    stores = (*cache._keys, *cache._values)
    assert not any(store is old for store in stores for old in before)  # the cache grew
    assert cache.growths == 2  # allocated, then grown once (neither step a drafting cost)
    for store in stores:  # where torch.compile's maybe_mark_dynamic keeps its marks
        assert {0, 1} <= set(getattr(store, "_dynamo_weak_dynamic_indices", ()))


def test_guards_on_the_models_own_layers_are_dropped_and_the_inputs_kept(models):
    _run(models, [_plan(models[0], [5], [0], 18), _plan(models[0], [1], [5], 19)])
    if not _GUARDS:  # a torch without isolate_recompiles keeps every guard
        pytest.skip("this torch takes no guard filter for a compiled function of its own")
    dropped = [name for name, kept in _GUARDS if not kept]
    kept = [name for name, kept in _GUARDS if kept]
    assert dropped and all("layers" in name for name in dropped)  # weights, callables
    assert not any(name.startswith(("layers", "type(layers")) for name in kept)
    assert any(name.startswith("hidden") for name in kept)  # the hidden states' shapes


def test_merged_adapters_run_the_graphs_their_model_compiled():
    # Each adapter's merged forward (rows all of one adapter: most draft forwards) takes the
    # graphs the base forward compiled, with its own weights: an adapter swapped in while
    # serving compiles nothing, and each computes what its eager merged forward computes.
    model = build_family("llama3", 6, num_hidden_layers=1)  # one layer: compiles faster
    draft = with_lora_adapters(model, ["code", "sql"], seed=7)
    with torch.no_grad():  # merged weights that differ from the base's visibly
        for name, param in draft.named_parameters():
            if "lora_B" in name:
                param.mul_(3.0)
    eager, compiled = CausalLM(draft, 64), CausalLM(draft, 64, compile=True)

    def steps(adapter: str | None) -> list[torch.Tensor]:
        plans = [_plan(eager, [6, 3], [0, 0], 40), _plan(eager, [1, 1], [6, 3], 41)]
        plans += [_plan(eager, [3, 3], [7, 4], 42)]
        outs = []
        for lm in (eager, compiled):
            cache = SlotKVCache(SLOTS, 160)
            with torch.inference_mode():
                for plan in plans:
                    width = plan.input_ids.shape[1]
                    rows = [adapter] * plan.input_ids.shape[0]
                    outs.append(lm.run(plan, cache, num_logits=width, adapters=rows))
        return outs

    base = steps(None)  # compiles the model's graphs
    warm = compile_stats().compilations
    assert compiled._merged_forward([None]).compiled
    by_adapter = {adapter: steps(adapter) for adapter in ("sql", "code")}
    assert compile_stats().compilations == warm  # the adapters' forwards compiled nothing
    assert compiled._compiled.functions == 1
    for outs in (base, *by_adapter.values()):
        half = len(outs) // 2
        for want, got in zip(outs[:half], outs[half:], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # The adapters' outputs are their own, not the base weights' run again.
    assert not torch.allclose(by_adapter["sql"][1], base[1], atol=1e-3)
    assert not torch.allclose(by_adapter["sql"][1], by_adapter["code"][1], atol=1e-3)


def test_greedy_speculation_gives_the_target_alones_tokens_when_compiled():
    target, draft = family_pair("llama3", 4)
    decoder = SpeculativeDecoder(target, draft, None, compile_forward=True, max_spec_tokens=4)
    assert decoder.target._lean_forward().compiled
    before = compile_stats().compilations
    assert_greedy_speculation_gives_the_target_alones_tokens(decoder)
    assert compile_stats().compilations > before  # its graphs, not an eager fallback


def assert_greedy_speculation_gives_the_target_alones_tokens(decoder) -> None:
    """Token and block verification, with and without the draft's ``sql`` adapter, greedy."""
    prompt = [3, 17, 9, 22, 41, 5, 8]
    greedy = {"max_tokens": 24, "temperature": 0.0, "stop_token_ids": []}
    alone = decoder.generate(prompt, method="none", **greedy).token_ids
    for method in ("token", "block"):
        for adapter in (None, "sql"):
            out = decoder.generate(
                prompt, method=method, num_spec_tokens=3, adapter=adapter, **greedy
            )
            assert out.token_ids == alone, (method, adapter)


def test_inductor_caches_under_osds_cache_directory_unless_told_otherwise(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("OSD_CACHE_DIR", str(tmp_path))
    assert persistent_inductor_cache() == tmp_path / "inductor"  # not torch's /tmp default
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert persistent_inductor_cache() == tmp_path / "mine"
    # torch fills the variable with its own default the first time it reads it (importing
    # transformers does): that is not a choice of the user's.
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    assert persistent_inductor_cache() == tmp_path / "inductor"


def test_a_failed_compilation_leaves_the_model_eager_with_a_warning(monkeypatch, caplog):
    # model.compile is on by default, so a machine where inductor cannot build (no C++
    # compiler, a backend that refuses the graph) must still serve, eagerly.
    def failing_backend(graph, example_inputs):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(compiled_forward, "_counting_inductor", failing_backend)
    model = build_family("llama3", 5)
    broken = CausalLM(model, 64, compile=True)
    assert broken._lean_forward().compiled
    reference = CausalLM(model, 64)
    # One warning a compiled model: the reference compiles too under OSD_TEST_COMPILE=1.
    models = 1 + reference._lean_forward().compiled
    failures = compile_stats().failures
    with caplog.at_level("WARNING", logger=compiled_forward.__name__):
        outs, caches = _run(
            (reference, broken),
            [_plan(broken, [5, 3], [0, 0], 8), _plan(broken, [1, 1], [5, 3], 9)],
        )
    for want, got in outs:
        torch.testing.assert_close(got, want)  # the eager forward's outputs
    for mine, theirs in zip(caches[1]._keys, caches[0]._keys, strict=True):
        torch.testing.assert_close(mine[:SLOTS], theirs[:SLOTS])  # written once, not twice
    assert compile_stats().failures == failures + models  # one a model, not one a step
    warned = [r for r in caplog.records if "torch.compile failed" in r.getMessage()]
    assert len(warned) == models
    assert all("no C++ compiler found" in r.getMessage() for r in warned)


def test_each_shape_class_settles_on_the_faster_of_compiled_and_eager(monkeypatch):
    # On the CPU a shape class times both ways for its first calls and keeps the faster: a
    # tiny draft's one-row forwards ran 0.82x eager compiled (the graph's fixed cost), its
    # 16-row ones 1.66x. Here a clock makes the compiled graph slow at one row only.
    model = build_family("llama3", 8)
    lm = CausalLM(model, 64, compile=True)
    layers_called: list[str] = []
    compiled_layers = lm._lean_forward().in_place_layers.func
    eager, function = compiled_layers._eager, compiled_layers._function

    def timed(kind, call, cost):
        def run(layers, *inputs):
            layers_called.append(kind)
            clock[0] += cost(inputs[0].shape[0])
            return call(layers, *inputs)

        return run

    clock = [0.0]
    monkeypatch.setattr(compiled_forward.time, "perf_counter", lambda: clock[0])
    compiled_layers._eager = timed("eager", eager, lambda rows: 1.0)
    compiled_layers._function = timed("compiled", function, lambda rows: 2.0 if rows == 1 else 0.5)
    choices = compile_stats().eager_choices
    rounds = 2 * compiled_forward._TRIALS + 3  # a compilation, the trials, two steps after
    plans = [_plan(lm, [6], [0], 50), _plan(lm, [5, 3], [0, 0], 51)]
    plans += [_plan(lm, [1], [6 + i], 52 + i) for i in range(rounds)]
    plans += [_plan(lm, [1, 1], [5 + i, 3 + i], 70 + i) for i in range(rounds)]
    with torch.inference_mode():
        cache = SlotKVCache(SLOTS, 160)
        lm.run(plans[0], cache, num_logits=1)
        layers_called.clear()
        for plan in plans[2 : 2 + rounds]:  # one row, one token a row
            lm.run(plan, cache, num_logits=1)
        one_row = list(layers_called)
        cache = SlotKVCache(SLOTS, 160)
        lm.run(plans[1], cache, num_logits=1)
        layers_called.clear()
        for plan in plans[2 + rounds :]:  # two rows
            lm.run(plan, cache, num_logits=1)
        two_rows = list(layers_called)
    assert compiled_layers._compiled_pays[(1, 1, False)] is False
    assert compiled_layers._compiled_pays[(2, 1, False)] is True
    assert one_row[-2:] == ["eager", "eager"]
    assert two_rows[-2:] == ["compiled", "compiled"]
    assert one_row.count("compiled") >= compiled_forward._TRIALS  # both were tried
    assert compile_stats().eager_choices == choices + 1
