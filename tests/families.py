"""Tiny random models of the families users serve, built from transformers' own config classes.

Each family is a (target, draft) pair of one architecture: the draft is a noisy copy of the
target (so drafts are often but not always accepted), wrapped in peft with two LoRA adapters.
Windows and chunks are a few tokens wide, so every test sequence passes them many times over.
Nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import transformers
from transformers import PretrainedConfig, PreTrainedModel

from osd.decode.models import auto_model_class

__all__ = ["FAMILIES", "WINDOW", "WINDOWED", "build_family", "family_pair", "noisy_family_copy"]

WINDOW = 8  # sliding window / attention chunk of the windowed families, in tokens
VOCAB = 64
HIDDEN = 32

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
    "tie_word_embeddings": False,
}


def _config(name: str, **overrides: Any) -> Callable[[], PretrainedConfig]:
    def make() -> PretrainedConfig:
        cls = getattr(transformers, name)
        return cls(**{**_COMMON, **overrides})

    return make


def _gemma3_vision() -> PretrainedConfig:
    """Gemma 3 of text and images (its 4B to 27B checkpoints): the decoder's layout lives in the
    text config, which the engine must read there; a tiny vision tower beside it."""
    text = FAMILIES["gemma3"]()  # the text-only family's decoder
    text.pad_token_id = 0  # (the model of text and images masks image ids with it)
    vision = transformers.SiglipVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        image_size=8, patch_size=4,
    )  # fmt: skip
    return transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=63
    )


def _mistral3_vision() -> PretrainedConfig:
    """Mistral Small 3.1 / 3.2 (text and images): transformers builds no causal LM of it; the
    engine loads the model of text and images and serves its text."""
    vision = transformers.PixtralVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        head_dim=8, image_size=16, patch_size=4,
    )  # fmt: skip
    text = _config("MistralConfig", sliding_window=None, head_dim=8)()
    return transformers.Mistral3Config(
        text_config=text, vision_config=vision, image_token_index=63, spatial_merge_size=1
    )


def _qwen25_vl() -> PretrainedConfig:
    """Qwen2.5-VL: no causal LM either, and multimodal RoPE (three position sections, one
    position each for text)."""
    rope = {"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 10000.0}
    vision = transformers.Qwen2_5_VLVisionConfig(
        depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=HIDDEN,
        fullatt_block_indexes=[0],
    )  # fmt: skip
    text = _config("Qwen2_5_VLTextConfig", rope_parameters=rope)()
    return transformers.Qwen2_5_VLConfig(
        text_config=text.to_dict(), vision_config=vision.to_dict(), image_token_id=63,
        video_token_id=62, vision_start_token_id=61,
    )  # fmt: skip


def _gpt2() -> PretrainedConfig:
    return transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=HIDDEN, n_layer=3, n_head=4, n_positions=512,
        bos_token_id=None, eos_token_id=None, tie_word_embeddings=False,
    )  # fmt: skip


def _neox() -> PretrainedConfig:
    return transformers.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, max_position_embeddings=512, bos_token_id=None,
        eos_token_id=None, tie_word_embeddings=False,
    )  # fmt: skip


_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
_MOE = {"num_local_experts": 4, "num_experts_per_tok": 2}

# name -> config builder. Windowed families have layers with a window (or chunk) of WINDOW.
FAMILIES: dict[str, Callable[[], PretrainedConfig]] = {
    "llama3": _config("LlamaConfig", rope_parameters=_LLAMA3_ROPE),
    "qwen2": _config("Qwen2Config"),
    "qwen2-sliding": _config(
        "Qwen2Config", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
    ),
    "qwen3": _config("Qwen3Config", head_dim=8),
    "mistral-sliding": _config("MistralConfig", sliding_window=WINDOW),
    "gemma2": _config(
        "Gemma2Config",
        head_dim=8,
        sliding_window=WINDOW,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0,
        query_pre_attn_scalar=8,
        attn_implementation="eager",  # soft-capping is eager-only in transformers
    ),
    "gemma3": _config(
        "Gemma3TextConfig",
        head_dim=8,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        final_logit_softcapping=3.0,
        query_pre_attn_scalar=8,
    ),
    "gemma3-vision": _gemma3_vision,
    # Gemma 4: per-layer inputs, the last layer sharing an earlier one's keys and values, the
    # full layers' heads wider than the sliding ones'.
    "gemma4": _config(
        "Gemma4TextConfig",
        head_dim=8,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "full_attention"],
        vocab_size_per_layer_input=VOCAB,
        hidden_size_per_layer_input=8,
        num_kv_shared_layers=1,
        per_layer_config={"01": {"head_dim": 16}, "02": {"head_dim": 16}},
        pad_token_id=0,
    ),
    # DeepSeek V3's multi-head latent attention (Kimi K2's, DeepSeek-V2-Lite's, GLM-4.7-Flash's):
    # keys of 12 (8 + 4 rotary) and values of 6 a head, from a compressed KV; MoE after layer 0.
    "deepseek-v3": _config(
        "DeepseekV3Config",
        kv_lora_rank=8,
        q_lora_rank=None,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=6,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
    ),
    "mistral3-vision": _mistral3_vision,
    "qwen2.5-vl": _qwen25_vl,
    "phi3": _config("Phi3Config", sliding_window=WINDOW),
    "gpt2": _gpt2,
    "gpt-neox": _neox,
    "mixtral": _config("MixtralConfig", **_MOE),
    "gpt-oss": _config(
        "GptOssConfig",
        head_dim=8,
        sliding_window=WINDOW,
        num_local_experts=4,
        num_experts_per_tok=2,
        attn_implementation="eager",  # attention sinks are eager-only in transformers
        rope_parameters={"rope_type": "default", "rope_theta": 150000.0},
    ),
    "olmo2": _config("Olmo2Config"),
    "cohere2": _config(
        "Cohere2Config",
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    ),
    "llama4-chunked": _config(
        "Llama4TextConfig",
        head_dim=8,
        attention_chunk_size=WINDOW,
        intermediate_size_mlp=64,
        num_local_experts=2,
        num_experts_per_tok=1,
        no_rope_layers=[1, 1, 0],
        layer_types=["chunked_attention", "chunked_attention", "full_attention"],
    ),
}


# The families with sliding-window or chunked layers (of WINDOW tokens).
WINDOWED = {
    "qwen2-sliding", "mistral-sliding", "gemma2", "gemma3", "gemma3-vision", "gemma4", "phi3",
    "gpt-oss", "cohere2", "llama4-chunked",
}  # fmt: skip


def build_family(name: str, seed: int, logit_scale: float = 4.0, **overrides: Any) -> Any:
    """A random target of family ``name`` in eval mode (float32), peaked by ``logit_scale``."""
    config = FAMILIES[name]()
    for key, value in overrides.items():
        setattr(config, key, value)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = auto_model_class(config).from_config(config)
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(logit_scale)
    return model.eval()


def noisy_family_copy(model: PreTrainedModel, noise: float, seed: int) -> Any:
    """A copy of ``model`` with Gaussian noise (relative scale ``noise``) on every weight."""
    copy = type(model)(model.config)
    copy.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in copy.parameters():
            if param.numel() > 1 and param.is_floating_point():
                param.add_(torch.randn(param.shape, generator=gen) * noise * param.std())
    return copy.eval()


# LoRA on the attention projections each family names its own way (MoE expert weights are
# parameters, not Linear layers, and peft's mixed-adapter batches do not take them).
ATTENTION_TARGETS = ["q_proj", "v_proj", "qkv_proj", "c_attn", "query_key_value"]


def family_pair(name: str, seed: int = 0) -> tuple[Any, Any]:
    """(target, draft): a random target and a noisy copy with LoRA adapters ``code``, ``sql``."""
    from peft import LoraConfig, get_peft_model

    target = build_family(name, seed)
    draft = noisy_family_copy(target, 0.1, seed + 1)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=ATTENTION_TARGETS, init_lora_weights=False
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed + 2)
        draft = get_peft_model(draft, config, adapter_name="code")
        draft.add_adapter("sql", config)
    with torch.no_grad():  # adapters that change the draft a little, as a trained one does
        for param_name, param in draft.named_parameters():
            if "lora_B" in param_name:
                param.mul_(0.1)
    return target, draft.eval()
