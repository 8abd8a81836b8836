"""Shared fixtures: tiny randomly initialised Hugging Face models built in code (no downloads)."""

from __future__ import annotations

import pytest
import torch

from osd.testing import char_tokenizer, noisy_copy, tiny_llama, with_lora_adapters

# Tiny models run fastest single-threaded; the CI machine has two cores.
torch.set_num_threads(1)


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
