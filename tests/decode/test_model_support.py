"""What the engine refuses when models load, and heads padded past the tokenizer."""

from __future__ import annotations

import pytest
import torch
import transformers

from osd import SpeculativeDecoder
from osd.decode.attention import AttentionLayout, UnsupportedModel, attention_layout
from osd.decode.attention_probe import cached_forward_error, check_cached_forward
from osd.decode.kv_cache import plan_forward
from osd.decode.loop import BatchedEngine
from osd.decode.models import CausalLM, load_causal_lm
from osd.decode.scheduler import BatchLimits
from osd.toy_models import char_tokenizer
from tests.families import build_family, family_pair


def tiny(config_name: str, **kwargs):
    config = getattr(transformers, config_name)(**kwargs)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize(
    ("build", "feature"),
    [
        (
            lambda: tiny(
                "MambaConfig", vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=1
            ),
            "state-space",
        ),
        (
            lambda: tiny(
                "Qwen3NextConfig",
                vocab_size=64,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=1,
                intermediate_size=32,
                num_experts=2,
                num_experts_per_tok=1,
                moe_intermediate_size=16,
                layer_types=["linear_attention", "full_attention"],
            ),  # fmt: skip
            "linear-attention",
        ),
    ],
    ids=["mamba", "qwen3-next"],
)
def test_models_with_recurrent_layers_are_refused_naming_class_and_feature(build, feature):
    model = build()
    with pytest.raises(UnsupportedModel, match=f"{type(model).__name__} has .*{feature}"):
        SpeculativeDecoder(model, model)


def test_unknown_layer_kinds_are_refused():
    model = build_family("qwen2", 0)
    model.config.layer_types = ["full_attention", "mystery_attention", "full_attention"]
    with pytest.raises(UnsupportedModel, match="Qwen2ForCausalLM has layers of kind mystery"):
        attention_layout(model)


def test_cross_attention_is_refused():
    model = build_family("gpt2", 0)
    model.config.add_cross_attention = True
    with pytest.raises(UnsupportedModel, match="GPT2LMHeadModel has cross-attention"):
        attention_layout(model)


@pytest.mark.parametrize(
    ("build", "feature"),
    [
        (
            lambda: tiny(
                "GPTNeoConfig",
                vocab_size=64,
                hidden_size=32,
                num_layers=2,
                num_heads=2,
                attention_types=[[["global", "local"], 1]],
                window_size=40,
            ),
            "local attention",
        ),
        (
            lambda: tiny(
                "FalconConfig",
                vocab_size=64,
                hidden_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                alibi=True,
            ),
            "ALiBi",
        ),
    ],
    ids=["gpt-neo-local", "falcon-alibi"],
)
def test_attention_osd_cannot_hold_is_refused_naming_it(build, feature):
    """Found by a sweep of transformers' families: GPT-Neo's local layers decoded other tokens
    in batches of rows of different lengths (its load check passed: the probe is shorter
    than the window); ALiBi failed inside the load check with an unrelated error."""
    model = build()
    with pytest.raises(UnsupportedModel, match=f"{type(model).__name__} has .*{feature}"):
        attention_layout(model)


def test_longrope_is_served_up_to_its_original_context_and_exactly():
    """Past original_max_position_embeddings transformers recomputes a LongRoPE model's cache
    with the long factors (and picks them per forward by the longest row): osd serves such a
    model up to that length, where every token is the model's own."""
    rope = {
        "rope_theta": 10000.0, "rope_type": "longrope", "factor": 512 / 40,
        "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [20.0, 30.0, 50.0, 90.0],
        "original_max_position_embeddings": 40,
    }  # fmt: skip
    model = tiny(
        "Phi3Config", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rope_parameters=rope, original_max_position_embeddings=40, pad_token_id=None,
        bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    decoder = SpeculativeDecoder(model, model)
    assert decoder.max_context == 40
    prompt = list(range(20, 40))
    out = decoder.generate(prompt, max_tokens=24, temperature=0, method="none")
    assert len(out.token_ids) == 20  # what the original context leaves
    want = model.generate(
        torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20, do_sample=False
    )
    assert out.token_ids == want[0, len(prompt) :].tolist()
    with pytest.raises(ValueError, match="context"):
        decoder.prepare(prompt, max_tokens=24, fit_context=False)


@pytest.mark.parametrize(
    ("family", "windows"),
    [
        ("llama3", {"full_attention": None}),
        ("mistral-sliding", {"sliding_attention": 8}),
        ("gemma2", {"full_attention": None, "sliding_attention": 8}),
        ("llama4-chunked", {"chunked_attention": 8, "full_attention": None}),
        # Models of text and images: their text config's.
        ("gemma3-vision", {"full_attention": None, "sliding_attention": 8}),
    ],
)
def test_layouts_come_from_the_config(family, windows):
    layout = attention_layout(build_family(family, 0))
    assert layout.windows == windows
    assert layout.by_kind == (len(windows) > 1)


def test_sliding_and_chunked_masks_follow_transformers_semantics():
    # One row of 12 tokens from position 0: key s is visible to query q when q-w < s <= q
    # (sliding, w = 3) or s // c == q // c and s <= q (chunked, c = 4).
    layout = AttentionLayout({"sliding_attention": 3, "chunked_attention": 4}, by_kind=True)
    plan = plan_forward(
        input_ids=torch.ones(1, 12, dtype=torch.int64),
        start=torch.tensor([0]),
        left=torch.tensor([0]),
        real=torch.tensor([12]),
        own_slot=torch.tensor([0]),
        base_slot=torch.tensor([0]),
        prefix_len=torch.tensor([0]),
        trash_slot=1,
        dtype=torch.float32,
        layout=layout,
    )
    assert isinstance(plan.attention_mask, dict)
    sliding = plan.attention_mask["sliding_attention"][0, 0] == 0  # (T, S)
    chunked = plan.attention_mask["chunked_attention"][0, 0] == 0
    q, s = torch.meshgrid(torch.arange(12), torch.arange(12), indexing="ij")
    assert torch.equal(sliding, (s <= q) & (s > q - 3))
    assert torch.equal(chunked, (s <= q) & (s // 4 == q // 4))


def test_the_load_check_refuses_a_model_served_with_the_wrong_layout():
    # A sliding-window model served as if every layer were full: what the engine did before it
    # knew of windows. The check finds it before any request does.
    model = build_family("mistral-sliding", 0)
    lm = CausalLM(model, 64)
    check_cached_forward(lm, "target")
    assert cached_forward_error(lm) < 1e-5
    lm.attention = AttentionLayout.full()
    with pytest.raises(UnsupportedModel, match="target model MistralForCausalLM .* differs"):
        check_cached_forward(lm, "target")


# Heads padded past the tokenizer: target 80 rows, draft 72, tokenizer 40 (Qwen2.5's shape:
# 151,936 / 152,064 rows and 151,665 tokens). The padded rows are made the most likely ones.
TOKENIZER_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 ?"  # 2 specials + 38 = 40 tokens


@pytest.fixture(scope="module")
def padded_pair():
    target = build_family("qwen2", 3, vocab_size=80)
    draft = family_pair("qwen2", 3)[1]
    draft.base_model.model.resize_token_embeddings(72)
    with torch.no_grad():  # padded row 40 + i scores twice real row i: the rows would win
        for model in (target, draft.get_base_model()):
            head = model.get_output_embeddings().weight
            head[40:] = 2 * head[: head.shape[0] - 40]
    tokenizer = char_tokenizer(TOKENIZER_CHARS)
    assert len(tokenizer) == 40
    return target, draft, tokenizer


@pytest.mark.parametrize("method", ["none", "token", "block", "spectr"])
@pytest.mark.parametrize("temperature", [0.0, 1.0, 3.0])
def test_padded_heads_never_emit_an_id_the_tokenizer_lacks(padded_pair, method, temperature):
    target, draft, tokenizer = padded_pair
    decoder = SpeculativeDecoder(target, draft, tokenizer)
    assert decoder.vocab_size == 40
    emitted: set[int] = set()
    for seed in range(4):
        result = decoder.generate(
            "abc", max_tokens=24, temperature=temperature, seed=seed, method=method,
            num_spec_tokens=3, num_drafts=2, stop_token_ids=[], top_k=0, logprobs=3,
        )  # fmt: skip
        emitted.update(result.token_ids)
        assert result.text == tokenizer.decode(result.token_ids, skip_special_tokens=True)
    assert emitted and max(emitted) < 40


def test_padded_heads_greedy_equals_generate_without_the_padded_rows(padded_pair):
    # The padded rows would win greedy decoding; without them (suppressed, as dropping their
    # logits does) the engine's output is the target's own.
    target, draft, tokenizer = padded_pair
    prompt = tokenizer("hello world")["input_ids"]
    unrestricted = target.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)
    assert max(unrestricted[0, len(prompt) :].tolist()) >= 40
    reference = target.generate(
        torch.tensor([prompt]),
        max_new_tokens=20,
        min_new_tokens=20,
        do_sample=False,
        suppress_tokens=list(range(40, 80)),
    )[0, len(prompt) :].tolist()
    decoder = SpeculativeDecoder(target, draft, tokenizer)
    engine = BatchedEngine(decoder, BatchLimits(max_num_seqs=4))
    try:
        handles = [
            engine.submit(
                decoder.prepare(
                    prompt,
                    max_tokens=20,
                    temperature=0,
                    method=method,
                    num_spec_tokens=3,
                    stop_token_ids=[],
                )  # fmt: skip
            )
            for method in ("none", "token", "block", "spectr")
        ]
        assert all(h.result().token_ids == reference for h in handles)
    finally:
        engine.close()


def test_heads_of_different_sizes_need_a_tokenizer_both_cover(padded_pair):
    target, draft, _ = padded_pair
    with pytest.raises(ValueError, match="different vocabularies"):
        SpeculativeDecoder(target, draft)


_MLA = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 32,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "kv_lora_rank": 8,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 2,
    "num_experts_per_tok": 1,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
}


@pytest.mark.parametrize("config", ["DeepseekV2Config", "Glm4MoeLiteConfig"])
def test_multi_head_latent_attention_is_served_keys_and_values_of_their_own_sizes(config):
    # DeepSeek-V2 / V3 (the matrix's deepseek-v3), Kimi K2, GLM-4.7-Flash. transformers
    # caches MLA's compressed KV (kv_lora_rank 8) as the "keys" and the rotary key
    # (qk_rope_head_dim 4) as the "values", one head each: the slot cache keeps each at its
    # own size, 12 floats a position and layer instead of two heads of 12 and 16.
    lm = CausalLM(tiny(config, **_MLA), 64)
    check_cached_forward(lm, "target")
    assert lm.kv_bytes_per_slot(8) == 8 * 2 * (8 + 4) * 4  # positions, layers, floats, bytes


def test_deepseek_v32s_indexed_attention_is_refused():
    indexed = {**_MLA, "index_n_heads": 2, "index_head_dim": 8, "index_topk": 4}
    with pytest.raises(UnsupportedModel, match="indexed_attention"):
        attention_layout(tiny("DeepseekV32Config", **indexed))


def test_the_context_is_read_where_each_family_declares_it():
    from osd.decode.attention import context_length

    assert context_length(transformers.MptConfig(max_seq_len=96)) == 96  # MPT's own name
    assert context_length(transformers.GPT2Config(n_positions=80)) == 80
    assert context_length(transformers.LlamaConfig(max_position_embeddings=64)) == 64
    assert context_length(build_family("gemma3-vision", 0).config) == 512  # its text config's


@pytest.mark.parametrize("family", ["mistral3-vision", "gemma3-vision"])
def test_a_checkpoint_of_text_and_images_loads_as_the_model_that_serves_its_text(family, tmp_path):
    # Mistral 3 has no causal LM class in transformers (AutoModelForCausalLM refuses its
    # config); Gemma 3 has one, its model of text and images.
    build_family(family, 0).save_pretrained(tmp_path)
    loaded = load_causal_lm(str(tmp_path), device="cpu")
    assert type(loaded).__name__.endswith("ForConditionalGeneration")
    check_cached_forward(CausalLM(loaded, 64), "target")
