"""The saved pair loads with the Auto classes and runs through the engine, with a distilled LoRA."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from osd import SpeculativeDecoder
from osd.demo import load_corpus_split
from osd.demo.distill import DistillRecipe, distill_adapter, forward_kl
from osd.demo.evaluation import decode_step_ms, measure_acceptance, perplexity
from osd.demo.training import encode_streams


@pytest.fixture(scope="module")
def pair(tiny_paths):
    target = AutoModelForCausalLM.from_pretrained(tiny_paths.target).eval()
    draft = AutoModelForCausalLM.from_pretrained(tiny_paths.draft).eval()
    return target, draft, AutoTokenizer.from_pretrained(tiny_paths.tokenizer)


def test_models_load_as_llama_sharing_the_tokenizer(pair, tiny_paths):
    target, draft, tokenizer = pair
    assert isinstance(target, LlamaForCausalLM) and isinstance(draft, LlamaForCausalLM)
    assert target.config.vocab_size == draft.config.vocab_size == len(tokenizer)
    assert target.config.eos_token_id == tokenizer.eos_token_id
    assert sum(p.numel() for p in draft.parameters()) < sum(p.numel() for p in target.parameters())
    own = AutoTokenizer.from_pretrained(tiny_paths.target)
    assert own("SELECT 1;")["input_ids"] == tokenizer("SELECT 1;")["input_ids"]


def test_tokenizer_prepends_bos_and_round_trips_any_text(pair):
    _, _, tokenizer = pair
    text = "déjà vu: {'x': 1}\n\tSELECT * FROM t; 🙂"
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids[1:]) == text


def test_engine_on_saved_paths_matches_target_greedy(tiny_paths, pair):
    target, _, tokenizer = pair
    engine = SpeculativeDecoder(str(tiny_paths.target), str(tiny_paths.draft), device="cpu")
    prompt = load_corpus_split(tiny_paths.corpus, "code", "heldout")[0].prompt
    result = engine.generate(prompt, max_tokens=24, temperature=0, stop_token_ids=[])
    prompt_ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    reference = target.generate(
        prompt_ids, max_new_tokens=24, min_new_tokens=24, do_sample=False, eos_token_id=None
    )
    assert result.token_ids == reference[0, prompt_ids.shape[1] :].tolist()
    assert result.stats.drafted > 0


def test_distilled_adapter_runs_through_the_engine_and_lowers_its_loss(tiny_paths, pair):
    target, _, tokenizer = pair
    draft = AutoModelForCausalLM.from_pretrained(tiny_paths.draft).eval()
    docs = load_corpus_split(tiny_paths.corpus, "sql", "train")
    streams = encode_streams(tokenizer, {"sql": [d.text for d in docs]})
    recipe = DistillRecipe(steps=12, batch_size=2, seq_len=32, lr=3e-2, warmup_steps=1, rank=4)
    result = distill_adapter(target, draft, streams, "sql", recipe)
    assert sum(result.losses[-3:]) < sum(result.losses[:3])
    engine = SpeculativeDecoder(target, result.draft, tokenizer)
    assert engine.adapters == ("sql",)
    prompts = [d.prompt for d in load_corpus_split(tiny_paths.corpus, "sql", "heldout")[:2]]
    base = measure_acceptance(engine, prompts, temperature=1.0, max_tokens=8)
    tuned = measure_acceptance(engine, prompts, temperature=1.0, max_tokens=8, adapter="sql")
    assert base.num_generated > 0 and tuned.num_generated > 0


def test_forward_kl_is_zero_for_equal_logits_and_positive_otherwise():
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(forward_kl(logits, logits), torch.tensor(0.0), atol=1e-6, rtol=0)
    assert float(forward_kl(logits, logits.flip(-1))) > 0


def test_perplexity_and_decode_cost_are_finite(pair, tiny_paths):
    target, draft, tokenizer = pair
    texts = [d.text for d in load_corpus_split(tiny_paths.corpus, "prose", "heldout")]
    ppl = perplexity(target, tokenizer, texts, max_len=64, batch_size=4)
    assert 1.0 < ppl < 2 * len(tokenizer)  # a few training steps: near uniform, but finite
    assert decode_step_ms(draft, context_len=8, num_steps=2, repeats=2) > 0
