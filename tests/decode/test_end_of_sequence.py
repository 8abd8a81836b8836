"""A reply ends at every end-of-sequence token the model's generation config names, not only the
tokenizer's: instruction-tuned models end their turn with one of those (Gemma's
``<end_of_turn>``, Llama 3's ``<|eot_id|>``, gpt-oss's ``<|call|>``), and a server that stopped
only at the tokenizer's would write past the end of every turn until ``max_tokens``."""

from __future__ import annotations

import pytest

from osd import SpeculativeDecoder
from osd.testing import char_tokenizer, save_toy_pair

TURN_END = 7  # a token the generation config names as an end of sequence


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A toy pair on disk whose target's generation_config.json ends at 1 (the tokenizer's
    end-of-sequence) and at TURN_END."""
    root = tmp_path_factory.mktemp("eos")
    save_toy_pair(root, char_tokenizer(), ends=[1, TURN_END], logit_scale=1.0)
    return root


@pytest.mark.parametrize("method", ["token", "block", "none"])
def test_the_generation_configs_end_of_sequence_ends_the_reply(saved, method):
    engine = SpeculativeDecoder(str(saved / "target"), str(saved / "draft"))
    assert engine.eos_token_ids == (1, TURN_END)
    # The turn's end made likely: the reply ends there, by itself, and writes nothing of it.
    ended = engine.generate(
        [5, 9, 14], max_tokens=12, temperature=0.0, method=method, logit_bias={TURN_END: 30.0}
    )
    assert ended.finish_reason == "stop" and ended.text == ""
    # A request's own stop tokens replace the defaults, as vLLM's stop_token_ids with
    # ignore_eos would: told to stop elsewhere, the reply runs on past the turn's end.
    through = engine.generate(
        [5, 9, 14],
        max_tokens=12,
        temperature=0.0,
        method=method,
        logit_bias={TURN_END: 30.0},
        stop_token_ids=[2],
    )
    assert through.finish_reason == "length" and TURN_END in through.token_ids
