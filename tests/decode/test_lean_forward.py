"""The lean forward (osd.decode.lean_forward): which families take it, and that it computes what
transformers' forward computes over the same slot cache, for ragged rows, shared prefixes,
in-place and gathered reads, windows, GQA, Qwen3's q/k norms and per-row LoRA adapters."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from peft import LoraConfig

from osd import SpeculativeDecoder
from osd.decode.forward import right_aligned, run_model
from osd.decode.kv_cache import (
    ForwardPlan,
    SlotKVCache,
    attention_split,
    packing,
    plan_forward,
)
from osd.decode.lean_forward import lean_forward_for
from osd.decode.models import CausalLM
from tests.families import FAMILIES, build_family, family_pair

LEAN = ["llama3", "qwen2", "qwen2-sliding", "qwen3", "mistral-sliding"]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_exactly_the_llama_shaped_families_take_the_lean_forward(name):
    model = build_family(name, 0)
    assert (lean_forward_for(model) is not None) == (name in LEAN)
    assert CausalLM(model, 64).uses_lean_forward == (name in LEAN)
    assert not CausalLM(model, 64, lean=False).uses_lean_forward


def _plan(lm, ids, start, left, real, own, base, prefix, first_slot=None, trash=4):
    column = lambda values: torch.tensor(values, dtype=torch.int64)  # noqa: E731
    return plan_forward(
        input_ids=torch.tensor(ids),
        start=column(start),
        left=column(left),
        real=column(real),
        own_slot=column(own),
        base_slot=column(base),
        prefix_len=column(prefix),
        trash_slot=trash,
        dtype=torch.float32,
        layout=lm.attention,
        first_slot=first_slot,
    )


def _steps(lm):
    """A prefill of two ragged rows, a decode step read in place, a verify-shaped step with
    right padding, and a branch reading its prefix from another slot (SpecTr), past the
    windows (8)."""
    gen = torch.Generator().manual_seed(0)
    tokens = lambda n: torch.randint(1, 60, (n,), generator=gen).tolist()  # noqa: E731
    a, b = tokens(14), tokens(9)
    yield _plan(lm, [a, [0] * 5 + b], [0, 0], [0, 5], [14, 9], [0, 1], [0, 1], [0, 0], 0)
    yield _plan(lm, [tokens(1), tokens(1)], [14, 9], [0, 0], [1, 1], [0, 1], [0, 1], [0, 0], 0)
    yield _plan(
        lm, [tokens(4), tokens(2) + [0, 0]], [15, 10], [0, 0], [4, 2], [0, 1], [0, 1], [0, 0]
    )
    yield _plan(lm, [tokens(3)], [19], [0], [3], [2], [0], [19])


@pytest.mark.parametrize("name", LEAN)
def test_lean_forward_equals_transformers_over_the_slot_cache(name):
    model = build_family(name, 1)
    lean, plain = CausalLM(model, 64), CausalLM(model, 64, lean=False)
    caches = [SlotKVCache(4, 64, lean.attention.spans, 16) for _ in range(2)]
    with torch.inference_mode():
        for plan in _steps(lean):
            got = lean.run(plan, caches[0], num_logits=plan.input_ids.shape[1])
            want = plain.run(plan, caches[1], num_logits=plan.input_ids.shape[1])
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", LEAN)
def test_a_packed_forward_computes_what_the_padded_one_does(name):
    """Only the real tokens computed (queries scattered into the grid for attention): the same
    logits at every real position, 0 at right padding, and the same keys and values cached."""
    model = build_family(name, 1)
    lean, plain = CausalLM(model, 64), CausalLM(model, 64, lean=False)
    caches = [SlotKVCache(4, 64, lean.attention.spans, 16) for _ in range(2)]
    with torch.inference_mode():
        for plan in _steps(lean):
            batch, width = plan.input_ids.shape
            real = (plan.write_slot != 4).sum(1).tolist()
            left = [int((plan.write_slot[b] != 4).int().argmax()) for b in range(batch)]
            packed = packing(left, real, width, width, "cpu", share=1.0)
            if packed is None:  # one row: nothing to pack
                continue
            got = lean.run(dataclasses.replace(plan, packed=packed), caches[0], num_logits=width)
            want = plain.run(plan, caches[1], num_logits=width)
            columns = torch.arange(width)
            is_real = (columns >= torch.tensor(left)[:, None]) & (
                columns < torch.tensor(left)[:, None] + torch.tensor(real)[:, None]
            )
            torch.testing.assert_close(got[is_real], want[is_real], rtol=1e-5, atol=1e-5)
            padding = is_real.logical_not() & (columns >= torch.tensor(left)[:, None])
            assert (got[padding] == 0).all()
        for mine, theirs in zip(caches[0]._keys, caches[1]._keys, strict=True):
            torch.testing.assert_close(mine[:4], theirs[:4], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", LEAN)
@pytest.mark.parametrize("in_place", [True, False])
def test_a_prompt_read_beside_decoding_rows_attends_apart_and_computes_what_the_grid_does(
    name, in_place
):
    """A 12-token prompt in the step of three rows verifying or decoding a few tokens (a prompt
    riding in a decode step, osd.decode.loop): its attention splits in two grids
    (kv_cache.attention_split), and it gives transformers' logits at every real position and
    the same cached keys, read in place or gathered, past the windows (8)."""
    model = build_family(name, 1)
    lean, plain = CausalLM(model, 64), CausalLM(model, 64, lean=False)
    caches = [SlotKVCache(6, 64, lean.attention.spans, 16) for _ in range(2)]
    gen = torch.Generator().manual_seed(3)
    tokens = lambda n: torch.randint(1, 60, (n,), generator=gen).tolist()  # noqa: E731
    prompts = [11, 9, 13]
    prefill = _plan(
        lean,
        [[0] * (13 - n) + tokens(n) for n in prompts],
        [0] * 3,
        [13 - n for n in prompts],
        prompts,
        [0, 1, 2],
        [0, 1, 2],
        [0] * 3,
        0,
    )
    # Columns 11-13 of a 14-wide grid: row 0 verifies 2 tokens (then right padding), row 1
    # decodes one, row 2 verifies 3; row 3's 12-token prompt fills columns 0-11.
    left, real = [11, 11, 11, 0], [2, 1, 3, 12]
    ids = [[0] * pad + tokens(n) + [0] * (14 - pad - n) for pad, n in zip(left, real, strict=True)]
    step = _plan(
        lean,
        ids,
        prompts + [0],
        left,
        real,
        [0, 1, 2, 3],
        [0, 1, 2, 3],
        [0] * 4,
        0 if in_place else None,
    )
    packed = packing(left, real, 14, 3, "cpu", narrow=4)
    assert packed is not None and packed.split is not None
    assert packed.split.tail == 3 and packed.split.wide.tolist() == [3]
    with torch.inference_mode():
        for lm, cache in zip((lean, plain), caches, strict=True):
            lm.run(prefill, cache, num_logits=1)
        got = lean.run(dataclasses.replace(step, packed=packed), caches[0], num_logits=3)
        want = plain.run(step, caches[1], num_logits=3)
    for b, (pad, count) in enumerate(zip(left, real, strict=True)):
        ends = [column - 11 for column in range(pad, pad + count) if column >= 11]
        torch.testing.assert_close(got[b, ends], want[b, ends], rtol=1e-5, atol=1e-5)
    for mine, theirs in zip(caches[0]._keys, caches[1]._keys, strict=True):
        torch.testing.assert_close(mine[:4], theirs[:4], rtol=1e-5, atol=1e-5)


def test_attention_splits_where_fewer_queries_attend():
    # (left padding, real tokens, width, narrow) -> (tail, wide rows) or None: of the narrow
    # rows' spans (at least 2) and the whole grid, the fewest query columns, a wide row
    # counted as its head's columns and 8 more (kv_cache._WIDE_ROW_COLUMNS).
    assert attention_split([13, 13, 0], [1, 1, 14], 14, 16) == (2, [2])  # 26 against 42
    assert attention_split([13, 13, 0], [1, 1, 14], 14, 4) == (2, [2])  # a tail of 2 at least
    assert attention_split([11, 12, 0], [3, 1, 12], 14, 4) == (3, [2])  # right padding counts
    assert attention_split([0, 10], [30, 20], 30, 16) is None  # no narrow row
    assert attention_split([1, 0], [2, 3], 3, 2) is None  # a head of one column
    assert attention_split([27, 0, 10, 28], [3, 30, 20, 2], 30, 16) == (3, [1, 2])
    # A verify step's rows right-aligned (forward.right_aligned): one row of 9 beside 15 of
    # one splits at 2 (47 columns against 144), and so do two of 9 beside 6 of one.
    assert attention_split([8] * 15 + [0], [1] * 15 + [9], 9, 16) == (2, [15])
    assert attention_split([8] * 6 + [0, 0], [1] * 6 + [9, 9], 9, 16) == (2, [6, 7])
    # Every row of 1-2 beside one of 3: the head of the one wide row does not pay for itself.
    assert attention_split([1, 2, 0], [2, 1, 3], 3, 16) is None
    # 12 rows of one beside 4 of 5: a tail of 2 (76 columns) before one of 5 (80).
    assert attention_split([4, 4, 4, 0] * 4, [1, 1, 1, 5] * 4, 5, 16) == (2, [3, 7, 11, 15])


@pytest.mark.parametrize("name", LEAN)
def test_a_verify_steps_right_padded_rows_run_right_aligned_and_split(name):
    """A verify step right-pads the rows that verify fewer tokens than the widest; packed,
    run_model right-aligns them so that their attention splits (one row verifying eight
    looked-up tokens beside rows of one or two pending), and the logits at every real
    position, in the caller's columns, and the cached keys are transformers' padded
    forward's, past the windows (8)."""
    model = build_family(name, 1)
    lean, plain = CausalLM(model, 64), CausalLM(model, 64, lean=False)
    assert lean.packs
    caches = [SlotKVCache(8, 64, lean.attention.spans, 16) for _ in range(2)]
    gen = torch.Generator().manual_seed(5)
    tokens = lambda n: torch.randint(1, 60, (n,), generator=gen).tolist()  # noqa: E731
    rows = 6
    prompts = [15, 12, 14, 11, 13, 16]
    prefill = _plan(
        lean,
        [[0] * (16 - n) + tokens(n) for n in prompts],
        [0] * rows,
        [16 - n for n in prompts],
        prompts,
        list(range(rows)),
        list(range(rows)),
        [0] * rows,
        0,
        trash=8,
    )
    # Two pending columns, then up to 8 drafted ones: row 0 drafted 8 after one pending
    # token, row 3 one after two, the others none (right padding). Row 0 is wide.
    pending, drafted = [1, 2, 1, 2, 1, 1], [8, 0, 0, 1, 0, 0]
    width = 2 + max(drafted)
    left = [2 - n for n in pending]
    real = [p + d for p, d in zip(pending, drafted, strict=True)]
    ids = [
        [0] * pad + tokens(n) + [0] * (width - pad - n) for pad, n in zip(left, real, strict=True)
    ]
    num_logits = max(drafted) + 1
    moved, aligned = right_aligned(torch.tensor(ids), left, real)
    assert aligned == [width - n for n in real]
    assert moved.tolist() == [
        [0] * (width - len(r)) + r
        for r in (row[p : p + n] for row, p, n in zip(ids, left, real, strict=True))
    ]
    found = packing(aligned, real, width, num_logits, "cpu", narrow=16, logits_left=left)
    assert found is not None and found.split is not None
    # A tail of 3 (row 3's span): 18 + 15 query columns, against 12 + 2 x 16 at 2.
    assert found.split.tail == 3 and found.split.wide.tolist() == [0]
    pair = SimpleNamespace(dtype=torch.float32)
    starts = prompts
    with torch.inference_mode():
        for lm, cache in zip((lean, plain), caches, strict=True):
            lm.run(prefill, cache, num_logits=1)
        got = run_model(  # type: ignore[arg-type]
            pair,
            lean,
            caches[0],
            torch.tensor(ids),
            start=starts,
            left=left,
            num_real=real,
            own=list(range(rows)),
            base=list(range(rows)),
            prefix=[0] * rows,
            num_logits=num_logits,
        )
        step = _plan(
            lean,
            ids,
            starts,
            left,
            real,
            list(range(rows)),
            list(range(rows)),
            [0] * rows,
            0,
            trash=8,
        )
        want = plain.run(step, caches[1], num_logits=num_logits)
    for b, (pad, count) in enumerate(zip(left, real, strict=True)):
        ends = [
            c - (width - num_logits) for c in range(pad, pad + count) if c >= width - num_logits
        ]
        assert ends == list(range(drafted[b] + 1))  # each row's verify positions
        torch.testing.assert_close(got[b, ends], want[b, ends], rtol=1e-5, atol=1e-5)
    for mine, theirs in zip(caches[0]._keys, caches[1]._keys, strict=True):
        torch.testing.assert_close(mine[:rows], theirs[:rows], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["llama3", "mistral-sliding"])
def test_a_packed_prefill_of_short_and_long_prompts_splits_with_several_wide_rows(name):
    """Prompts of 3 and 2 tokens beside ones of 20 and 30: the long ones are the wide rows
    (eagerly: the compiled graph takes one), and the logits and keys are transformers'."""
    model = build_family(name, 1)
    lean, plain = CausalLM(model, 64), CausalLM(model, 64, lean=False)
    caches = [SlotKVCache(6, 64, lean.attention.spans, 40) for _ in range(2)]
    lengths, width = [3, 20, 30, 2], 30
    left = [width - n for n in lengths]
    ids = torch.randint(1, 60, (4, width), generator=torch.Generator().manual_seed(4))
    ids = [row.tolist() for row in ids]
    plan = _plan(lean, ids, [0] * 4, left, lengths, [0, 1, 2, 3], [0, 1, 2, 3], [0] * 4, 0)
    packed = packing(left, lengths, width, 1, "cpu", narrow=16)
    assert packed is not None and packed.split is not None
    assert packed.split.tail == 3 and packed.split.wide.tolist() == [1, 2]
    with torch.inference_mode():
        got = lean.run(dataclasses.replace(plan, packed=packed), caches[0], num_logits=1)
        want = plain.run(plan, caches[1], num_logits=1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for mine, theirs in zip(caches[0]._keys, caches[1]._keys, strict=True):
        torch.testing.assert_close(mine[:4], theirs[:4], rtol=1e-5, atol=1e-5)


def test_a_model_with_lora_is_never_run_packed():
    target, draft = family_pair("llama3")
    assert CausalLM(target, 64).packs and not CausalLM(target, 64, lean=False).packs
    draft_lm = CausalLM(draft, 64)
    assert draft_lm.uses_lean_forward and not draft_lm.packs
    plan = dataclasses.replace(
        ForwardPlan.make_dummy(2, 3, 4), packed=packing([0, 0], [3, 1], 3, 1, "cpu")
    )
    with pytest.raises(ValueError, match="packs"):
        draft_lm.run(plan, SlotKVCache(4, 64), num_logits=1)


def test_in_place_reads_equal_gathered_reads():
    model = build_family("qwen2", 2)
    lm = CausalLM(model, 64)
    caches = [SlotKVCache(4, 64) for _ in range(2)]
    ids, start, real = [[5, 6, 7], [8, 9, 10]], [0, 0], [3, 3]
    with torch.inference_mode():
        for first_slot, cache in zip((1, None), caches, strict=True):
            lm.run(
                _plan(lm, ids, start, [0, 0], real, [1, 2], [1, 2], [0, 0], first_slot),
                cache,
                num_logits=1,
            )
        outs = [
            lm.run(
                _plan(lm, [[11], [12]], [3, 3], [0, 0], [1, 1], [1, 2], [1, 2], [0, 0], first),
                cache,
                num_logits=1,
            )
            for first, cache in zip((1, None), caches, strict=True)
        ]
    if lm._lean_forward().compiled:  # OSD_TEST_COMPILE: in place is compiled, gathered eager
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)
    else:
        assert torch.equal(outs[0], outs[1])


def test_per_row_lora_adapters_and_an_adapter_added_while_serving_take_effect():
    target, draft = family_pair("llama3", 3)
    lean, plain = CausalLM(draft, 64), CausalLM(draft, 64, lean=False)

    def compare(adapters):
        caches = [SlotKVCache(4, 64) for _ in range(2)]
        ids = [[3, 4, 5, 6], [7, 8, 9, 10], [11, 12, 13, 14]]
        plan = _plan(lean, ids, [0] * 3, [0] * 3, [4] * 3, [0, 1, 2], [0, 1, 2], [0] * 3, 0)
        with torch.inference_mode():
            got = lean.run(plan, caches[0], num_logits=4, adapters=adapters)
            want = plain.run(plan, caches[1], num_logits=4, adapters=adapters)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        return got

    before = compare(["code", "sql", None])
    # A replica adds a new version of an adapter while serving (same target modules).
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    draft.add_adapter("sql-v2", config)
    after = compare(["code", "sql-v2", None])
    assert not torch.allclose(before[1], after[1])  # the new version changed its row
    torch.testing.assert_close(before[0], after[0])  # and nothing else
    torch.testing.assert_close(before[2], after[2])


def test_lora_on_embeddings_mlp_and_head_as_the_demo_distils_them():
    """The demo's adapters train the embeddings, every projection and the head: each row's
    adapter must reach every one of them (a lean forward that read the embedding's base weights
    ran the distilled SQL adapter at acceptance 0.01 instead of 0.45)."""
    from peft import get_peft_model

    draft = build_family("llama3", 5)
    targets = ["embed_tokens", "q_proj", "v_proj", "gate_proj", "down_proj", "lm_head"]
    config = LoraConfig(r=4, target_modules=targets, init_lora_weights=False)
    draft = get_peft_model(draft, config, adapter_name="a")
    draft.add_adapter("b", config)
    lean, plain = CausalLM(draft, 64), CausalLM(draft, 64, lean=False)
    caches = [SlotKVCache(4, 64) for _ in range(2)]
    ids = [[3, 4, 5, 6], [7, 8, 9, 10], [11, 12, 13, 14]]
    plan = _plan(lean, ids, [0] * 3, [0] * 3, [4] * 3, [0, 1, 2], [0, 1, 2], [0] * 3, 0)
    with torch.inference_mode():
        got = lean.run(plan, caches[0], num_logits=4, adapters=["a", "b", None])
        want = plain.run(plan, caches[1], num_logits=4, adapters=["a", "b", None])
        base = CausalLM(build_family("llama3", 5), 64).run(plan, SlotKVCache(4, 64), num_logits=4)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got[0], base[0]) and not torch.allclose(got[1], got[0])
    torch.testing.assert_close(got[2], base[2], rtol=1e-5, atol=1e-5)


def test_the_switch_gives_the_same_output():
    target, draft = family_pair("qwen3", 4)
    outputs = []
    for lean in (True, False):
        decoder = SpeculativeDecoder(target, draft, lean_forward=lean)
        assert decoder.target.uses_lean_forward == lean
        result = decoder.generate(
            [3, 5, 7, 9], max_tokens=16, temperature=0, method="block", stop_token_ids=[]
        )
        outputs.append(result.token_ids)
    assert outputs[0] == outputs[1]


def _demo_shaped_lora_draft(seed: int = 5):
    """A draft with LoRA adapters ``sql`` and ``code`` on its embeddings, projections and head."""
    from peft import get_peft_model

    targets = ["embed_tokens", "q_proj", "v_proj", "gate_proj", "down_proj", "lm_head"]
    config = LoraConfig(r=4, target_modules=targets, init_lora_weights=False)
    draft = get_peft_model(build_family("llama3", seed), config, adapter_name="sql")
    draft.add_adapter("code", config)
    return draft.eval()


@pytest.mark.parametrize("adapter", ["sql", "code", None])
def test_rows_of_one_adapter_run_a_merged_forward_that_computes_the_per_row_one(adapter):
    """Every row on one adapter (or none): each LoRA layer merged into one plain weight gives
    the per-row LoRA forward's logits and caches the same keys and values."""
    draft = _demo_shaped_lora_draft()
    merged, per_row = CausalLM(draft, 64), CausalLM(draft, 64, merged_limit=0)
    caches = [SlotKVCache(4, 64) for _ in range(2)]
    with torch.inference_mode():
        for plan in _steps(merged):
            adapters = [adapter] * plan.input_ids.shape[0]
            got = merged.run(plan, caches[0], num_logits=2, adapters=adapters)
            want = per_row.run(plan, caches[1], num_logits=2, adapters=adapters)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert list(merged._merged) == [adapter] and merged._merged[adapter] is not None
    assert not per_row._merged  # the control ran per row
    for mine, theirs in zip(caches[0]._keys, caches[1]._keys, strict=True):
        torch.testing.assert_close(mine[:4], theirs[:4], rtol=1e-5, atol=1e-5)


def test_mixed_adapters_run_per_row_and_merged_forwards_are_bounded_and_dropped():
    draft = _demo_shaped_lora_draft()
    lm = CausalLM(draft, 64, merged_limit=2)
    ids = [[3, 4, 5], [6, 7, 8]]
    plan = lambda: _plan(lm, ids, [0, 0], [0, 0], [3, 3], [0, 1], [0, 1], [0, 0], 0)  # noqa: E731
    with torch.inference_mode():
        mixed = lm.run(plan(), SlotKVCache(4, 64), num_logits=3, adapters=["sql", "code"])
        assert not lm._merged  # two adapters in one forward: per row
        alone = [
            lm.run(plan(), SlotKVCache(4, 64), num_logits=3, adapters=[n, n])
            for n in ("sql", "code")
        ]
        torch.testing.assert_close(mixed[0], alone[0][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mixed[1], alone[1][1], rtol=1e-5, atol=1e-5)
        lm.run(plan(), SlotKVCache(4, 64), num_logits=3)  # the base: a third, "sql" goes
        assert list(lm._merged) == ["code", None]
        draft.add_adapter("json", LoraConfig(r=4, target_modules=["q_proj"]))
        lm.run(plan(), SlotKVCache(4, 64), num_logits=3, adapters=["json", "json"])
        assert list(lm._merged) == ["json"]  # the adapters changed: the others were dropped


def test_an_adapter_peft_treats_specially_is_not_merged():
    from peft import get_peft_model

    config = LoraConfig(
        r=4, target_modules=["q_proj", "v_proj"], lora_bias=True, init_lora_weights=False
    )
    draft = get_peft_model(build_family("llama3", 5), config, adapter_name="sql").eval()
    lm = CausalLM(draft, 64)
    plan = _plan(lm, [[3, 4, 5]], [0], [0], [3], [0], [0], [0], 0)
    with torch.inference_mode():
        got = lm.run(plan, SlotKVCache(4, 64), num_logits=3, adapters=["sql"])
        want = CausalLM(draft, 64, lean=False).run(
            plan, SlotKVCache(4, 64), num_logits=3, adapters=["sql"]
        )
    assert lm._merged == {"sql": None}  # a LoRA bias: per row
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_decoder_passes_its_merged_draft_limit_on():
    target, draft = family_pair("llama3")
    assert SpeculativeDecoder(target, draft).draft.merged_limit == 4
    assert SpeculativeDecoder(target, draft, merged_drafts=0).draft.merged_limit == 0


def test_a_merged_forward_keeps_no_autograd_graph_of_a_trainable_adapter():
    draft = _demo_shaped_lora_draft()  # peft leaves its LoRA weights trainable
    assert any(p.requires_grad for n, p in draft.named_parameters() if "lora_" in n)
    lm = CausalLM(draft, 64)
    plan = _plan(lm, [[3, 4, 5]], [0], [0], [3], [0], [0], [0], 0)
    logits = lm.run(plan, SlotKVCache(4, 64), num_logits=3, adapters=["sql"])  # no no_grad
    assert lm._merged["sql"] is not None and not logits.requires_grad


@pytest.mark.parametrize("width", [1, 3])
@pytest.mark.parametrize(("heads", "heads_kv"), [(2, 2), (8, 2), (4, 1)])
def test_attention_by_products_computes_what_sdpa_does(heads, heads_kv, width):
    # The compiled CPU forward's attention at a few tokens a row: keys read token-major where
    # the slot cache keeps them (a view with the capacity's strides), rows of several lengths
    # masked causally as the plans mask them (the dtype's minimum, not -inf), grouped-query
    # heads.
    from osd.decode.lean_forward import _attend_by_products

    gen = torch.Generator().manual_seed(0)
    rows, capacity, span, dim = 3, 40, 29, 16
    stores = [torch.randn(rows, capacity, heads_kv, dim, generator=gen) for _ in range(2)]
    keys, values = (store[:, :span] for store in stores)
    q = torch.randn(rows, width, heads, dim, generator=gen)
    lengths = torch.tensor([29, 7, width])  # keys of each row; its queries are the last ones
    query_pos = lengths[:, None] - width + torch.arange(width)  # (B, T)
    hidden = torch.arange(span).view(1, 1, span) > query_pos[..., None]  # (B, T, S)
    mask = torch.zeros(rows, 1, width, span).masked_fill_(
        hidden.unsqueeze(1), torch.finfo(torch.float32).min
    )
    layer = type("Layer", (), {"scaling": dim**-0.5})()
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=mask,
        scale=layer.scaling,
        enable_gqa=heads != heads_kv,
    ).transpose(1, 2)
    got = _attend_by_products(layer, q, keys, values, mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # Row 2's first query sees the row's first key alone: its output is that key's value.
    group = heads // heads_kv
    torch.testing.assert_close(
        got[2, 0], values[2, 0].repeat_interleave(group, dim=0), rtol=1e-6, atol=1e-6
    )


@pytest.mark.parametrize("name", LEAN)
def test_many_rows_of_one_token_attend_by_products_as_transformers_would(name, monkeypatch):
    # From 8 rows of one token a row the eager CPU forward attends by products and sums:
    # ragged rows past the windows (8), read in place, against transformers' own forward.
    from osd.decode import lean_forward

    calls = []
    products = lean_forward._attend_by_products
    monkeypatch.setattr(
        lean_forward,
        "_attend_by_products",
        lambda *args: calls.append(args[1].shape) or products(*args),
    )
    model = build_family(name, 1)
    lean, plain = CausalLM(model, 64), CausalLM(model, 64, lean=False)
    rows = 9
    caches = [SlotKVCache(rows, 64, lean.attention.spans, 32) for _ in range(2)]
    gen = torch.Generator().manual_seed(0)
    lengths = [3 + 2 * row for row in range(rows)]  # 3..19 tokens
    column = lambda values: torch.tensor(values, dtype=torch.int64)  # noqa: E731

    def plan(width, start, real):
        return plan_forward(
            input_ids=torch.randint(1, 60, (rows, width), generator=gen),
            start=column(start),
            left=column([width - n for n in real]),
            real=column(real),
            own_slot=column(range(rows)),
            base_slot=column(range(rows)),
            prefix_len=column([0] * rows),
            trash_slot=rows,
            dtype=torch.float32,
            layout=lean.attention,
            first_slot=0,
        )

    plans = [plan(max(lengths), [0] * rows, lengths)]
    plans += [plan(1, [n + step for n in lengths], [1] * rows) for step in range(3)]
    with torch.inference_mode():
        for each in plans:
            got = lean.run(each, caches[0], num_logits=1)
            want = plain.run(each, caches[1], num_logits=1)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert calls and all(shape[:2] == (rows, 1) for shape in calls)
