"""The corpus: every domain present, held-out apart from training, prompts cut cleanly, seeded."""

from __future__ import annotations

import random

import pytest

from osd.demo import DOMAINS, load_corpus_split, recipe_for
from osd.demo.corpus import build_corpus
from osd.demo.synthetic import json_document, math_document, sql_document


@pytest.mark.parametrize("domain", DOMAINS)
def test_every_domain_has_training_and_heldout_documents(tiny_paths, domain):
    train = load_corpus_split(tiny_paths.corpus, domain, "train")
    heldout = load_corpus_split(tiny_paths.corpus, domain, "heldout")
    assert train and len(heldout) == recipe_for("tiny").corpus.num_heldout
    assert not {d.text for d in heldout} & {d.text for d in train}
    for doc in heldout:
        assert 0 < doc.prompt_chars < len(doc.text)
        assert doc.text.startswith(doc.prompt)
        if domain == "chat":  # ends with the template's generation prompt (a marker, "\n")
            assert doc.prompt.endswith("<|assistant|>\n") and doc.topic
        else:  # the prompt ends where a token ends inside the text: never on whitespace
            assert not doc.prompt[-1].isspace()


def test_corpus_is_deterministic(tiny_paths):
    corpus = build_corpus(recipe_for("tiny").corpus)
    for domain in DOMAINS:
        saved = load_corpus_split(tiny_paths.corpus, domain, "train")
        assert [d.text for d in corpus[domain]["train"]] == [d.text for d in saved]


def test_unknown_split_raises_naming_it(tiny_paths):
    with pytest.raises(ValueError, match="'valid'"):
        load_corpus_split(tiny_paths.corpus, "sql", "valid")


@pytest.mark.parametrize("generate", [sql_document, math_document, json_document])
def test_generated_documents_depend_only_on_the_seed(generate):
    first = [generate(random.Random(7)).text for _ in range(3)]
    second = [generate(random.Random(7)).text for _ in range(3)]
    assert first == second
    assert generate(random.Random(8)).text != first[0]


def test_chat_domain_holds_dialogues_answering_in_every_topic(tiny_paths):
    docs = load_corpus_split(tiny_paths.corpus, "chat", "train")
    assert all(d.text.startswith(("<|user|>\n", "<|system|>\n")) for d in docs)
    assert all(d.text.endswith("<|endoftext|>") and "<|assistant|>\n" in d.text for d in docs)
    by_topic = {d.topic: d.text for d in docs}
    assert "def " in by_topic["code"] and "Write a Python function" in by_topic["code"]
    assert "SELECT" in by_topic["sql"] or "UPDATE" in by_topic["sql"] or "INTO" in by_topic["sql"]


def test_domains_have_their_own_look():
    rng = random.Random(0)
    assert "SELECT" in sql_document(rng).text or "UPDATE" in sql_document(rng).text
    assert math_document(rng).prompt.endswith("Answer:")
    assert json_document(rng).text.lstrip()[0] in "[{"
