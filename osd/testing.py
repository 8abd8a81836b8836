"""Test helpers: the tiny models and character tokenizer of :mod:`osd.toy_models`, for tests,
examples and benchmarks on machines that cannot download models (production code imports
:mod:`osd.toy_models` itself, never this module)."""

from __future__ import annotations

from osd.toy_models import char_tokenizer, noisy_copy, tiny_llama, with_lora_adapters

__all__ = ["char_tokenizer", "noisy_copy", "tiny_llama", "with_lora_adapters"]
