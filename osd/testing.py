"""Test helpers: the tiny models and character tokenizer of :mod:`osd.toy_models`, for tests,
examples and benchmarks on machines that cannot download models (production code imports
:mod:`osd.toy_models` itself, never this module)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from osd.toy_models import char_tokenizer, noisy_copy, tiny_llama, with_lora_adapters

__all__ = ["char_tokenizer", "noisy_copy", "save_toy_pair", "tiny_llama", "with_lora_adapters"]


def save_toy_pair(
    root: Path, tokenizer: Any, ends: Sequence[int] | None = None, logit_scale: float = 4.0
) -> tuple[Path, Path]:
    """A toy target (beside ``tokenizer``, whose vocabulary it takes) and its noisy draft,
    saved under ``root`` as a server loads a pair from disk: (target path, draft path).

    Args:
        ends: the end-of-sequence ids its ``generation_config.json`` names (None: the
            tokenizer's alone).
    """
    target = tiny_llama(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_layers=2,
        seed=0,
        logit_scale=logit_scale,
        eos_token_id=tokenizer.eos_token_id,
    )
    if ends is not None:
        target.generation_config.eos_token_id = list(ends)
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    noisy_copy(target, 0.1, seed=1).save_pretrained(root / "draft")
    return root / "target", root / "draft"
