"""The decoding methods, named here once (the decode core owns them).

``token``, ``block`` and ``spectr`` verify drafts (:mod:`osd.decode.verification`); ``none``
decodes with the target alone. A log record stores a method as its index in :data:`METHODS`
(:mod:`osd.buffer.wire`), so the order is part of the wire format: append only. The config,
the HTTP API and the record schema import them from here.
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = [
    "BASE_DRAFT_NAME",
    "METHODS",
    "PROPOSERS",
    "PROPOSER_CHOICES",
    "Method",
    "ProposerChoice",
]

Method = Literal["token", "block", "spectr", "none"]
METHODS: tuple[Method, ...] = get_args(Method)

# The name a request drafted by the base draft (no adapter) is counted and logged under.
BASE_DRAFT_NAME = "base"

# Who drafts a request's tokens (osd.decode.proposers): the goodput controller's choice per
# step, or one proposer pinned: the draft model, suffix decoding or prompt lookup.
ProposerChoice = Literal["auto", "draft", "suffix", "ngram"]
PROPOSER_CHOICES: tuple[ProposerChoice, ...] = get_args(ProposerChoice)
# The proposers a step's drafts come from; a record stores each step's as its index here
# (osd.buffer.wire, schema 2), so the order is part of the wire format: append only.
PROPOSERS: tuple[str, ...] = ("draft", "suffix", "ngram")
