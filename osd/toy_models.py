"""Tiny randomly initialised models and a character tokenizer, built in code.

The ``toy:`` models of a config (``model.target=toy:target``) are built here, so a deployment
can run end to end on a machine that cannot download models; tests, examples and benchmarks use
the same builders through :mod:`osd.testing`. Nothing here is used when serving real models.
"""

from __future__ import annotations

import string
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

__all__ = ["char_tokenizer", "noisy_copy", "tiny_llama", "with_lora_adapters"]

# Printable characters; the first ids are the special tokens.
_SPECIALS = ["<pad>", "<eos>"]
_CHARS = list(string.ascii_lowercase + string.digits + " .,:;!?()[]{}=+-*/'\"\n<>_#@")


def char_tokenizer(chars: str | None = None) -> PreTrainedTokenizerFast:
    """A character-level tokenizer: ids 0, 1 are <pad>, <eos>, then one id per character.

    Args:
        chars: the characters; default: lowercase letters, digits and punctuation (64 tokens
            in all: the toy models' vocabulary).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(_SPECIALS + (list(chars) if chars else _CHARS))}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", unk_token="?"
    )


def tiny_llama(
    *,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    seed: int,
    logit_scale: float = 1.0,
    max_positions: int = 512,
    eos_token_id: int | None = None,
) -> LlamaForCausalLM:
    """A random Llama in eval mode; ``logit_scale`` > 1 makes its distributions more peaked."""
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=max(1, hidden_size // 16),
        num_key_value_heads=max(1, hidden_size // 16),
        max_position_embeddings=max_positions,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        with torch.no_grad():
            model.lm_head.weight.mul_(logit_scale)
    return model.eval()


def noisy_copy(model: LlamaForCausalLM, noise: float, seed: int) -> LlamaForCausalLM:
    """A copy of ``model`` with Gaussian noise (relative scale ``noise``) on every weight.

    A draft that agrees with the target often but not always, as a trained draft does.
    """
    copy = LlamaForCausalLM(model.config)
    copy.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in copy.parameters():
            scale = noise * param.std() if param.numel() > 1 else 0.0
            param.add_(torch.randn(param.shape, generator=gen) * scale)
    return copy.eval()


def with_lora_adapters(model: Any, names: list[str], seed: int, rank: int = 4) -> Any:
    """Wraps a model in peft with randomly initialised (non-identity) LoRA adapters."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, config, adapter_name=names[0])
        for name in names[1:]:
            peft_model.add_adapter(name, config)
    return peft_model.eval()
