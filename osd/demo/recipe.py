"""The recipe of the demo model pair: every size, step count and seed, and its hash.

The hash names the cache directory and is checked by every stage's manifest, so a change to any
value here (or to :data:`BUILD_VERSION`, bumped whenever a code change alters what a build
produces, or to the Python minor version, whose standard library is the corpus) builds afresh.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "BUILD_VERSION",
    "CHAT_TOPICS",
    "DOMAINS",
    "CorpusRecipe",
    "ModelRecipe",
    "Recipe",
    "Scale",
    "TEXT_DOMAINS",
    "TokenizerRecipe",
    "TrainRecipe",
    "recipe_for",
]

# Bump when a code change alters the corpus, tokenizer or weights a recipe produces.
BUILD_VERSION = 3  # 2: the chat domain, role tokens, chat template; 3: tools in chats
# Domains whose held-out prompts are plain text (completions); chat's are dialogues.
TEXT_DOMAINS = ("prose", "code", "sql", "math", "json")
DOMAINS = (*TEXT_DOMAINS, "chat")
# What a chat dialogue of the corpus is about (its held-out requests are routed by it).
CHAT_TOPICS = ("code", "sql", "math", "json")
Scale = Literal["tiny", "full"]

EOS_TOKEN, BOS_TOKEN, PAD_TOKEN = "<|endoftext|>", "<|bos|>", "<|pad|>"
# The chat template's role markers (osd.demo.chat): one special token each, never split or merged.
SYSTEM_TOKEN, USER_TOKEN, ASSISTANT_TOKEN = "<|system|>", "<|user|>", "<|assistant|>"
ROLE_TOKENS = (SYSTEM_TOKEN, USER_TOKEN, ASSISTANT_TOKEN)
SPECIAL_TOKENS = (EOS_TOKEN, BOS_TOKEN, PAD_TOKEN, *ROLE_TOKENS)  # ids 0, 1, 2, then 3, 4, 5
_NUM_BYTES = 256


def _check_domains(name: str, domains: dict[str, Any]) -> None:
    unknown = sorted(set(domains) - set(DOMAINS))
    if unknown or not domains:
        raise ValueError(f"{name} must name domains among {DOMAINS}, got {sorted(domains)}")


@dataclass(frozen=True)
class CorpusRecipe:
    """What goes into the corpus.

    Attributes:
        max_train_chars: per domain, the most characters of training documents.
        num_heldout: per domain, held-out documents (their prefixes are the prompts).
        max_doc_chars: longer stdlib documents are cut at a line or character boundary.
        heldout_every: every n-th sorted stdlib file is held out.
        max_stdlib_files: read only the first n sorted stdlib files (None: all).
        seed: seed of shuffling and of the generated domains.
    """

    max_train_chars: dict[str, int]
    num_heldout: int = 300
    max_doc_chars: int = 3000
    heldout_every: int = 10
    max_stdlib_files: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if set(self.max_train_chars) != set(DOMAINS):
            raise ValueError(
                f"max_train_chars must cover exactly {DOMAINS}, got {sorted(self.max_train_chars)}"
            )
        if self.num_heldout < 1:
            raise ValueError(f"num_heldout must be >= 1, got {self.num_heldout}")
        if self.heldout_every < 2:
            raise ValueError(f"heldout_every must be >= 2, got {self.heldout_every}")


@dataclass(frozen=True)
class TokenizerRecipe:
    """Byte-level BPE: 256 byte tokens, the special tokens, then merges up to ``vocab_size``."""

    vocab_size: int
    min_frequency: int = 2

    def __post_init__(self) -> None:
        if self.vocab_size < _NUM_BYTES + len(SPECIAL_TOKENS):
            raise ValueError(
                f"vocab_size must be >= {_NUM_BYTES + len(SPECIAL_TOKENS)} (bytes + special "
                f"tokens), got {self.vocab_size}"
            )


@dataclass(frozen=True)
class ModelRecipe:
    """A Llama architecture (``LlamaForCausalLM``).

    Attributes:
        tie_embeddings: share the input embedding and output head (fewer weights to learn from
            little data); drafts keep them apart so LoRA can adapt each.
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_positions: int = 256
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}"
            )
        if min(self.num_layers, self.intermediate_size, self.max_positions) < 1:
            raise ValueError(f"sizes must be positive, got {self}")


@dataclass(frozen=True)
class TrainRecipe:
    """Next-token training on packed random windows of the domains' token streams.

    Attributes:
        domains: domain -> share of every batch's sequences.
        steps: optimizer steps; the step's batch depends only on (seed, step), so a resumed run
            sees the same data as an uninterrupted one.
        batch_size: sequences per step.
        seq_len: tokens per sequence.
        lr: peak AdamW learning rate, after ``warmup_steps`` linear warm-up, cosine decay to
            ``min_lr_ratio * lr``.
        checkpoint_every: steps between resumable checkpoints (safetensors + JSON).
    """

    domains: dict[str, float]
    steps: int
    batch_size: int
    seq_len: int
    lr: float
    warmup_steps: int
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    checkpoint_every: int = 50
    seed: int = 0

    def __post_init__(self) -> None:
        _check_domains("domains", self.domains)
        if any(share <= 0 for share in self.domains.values()):
            raise ValueError(f"domain shares must be positive, got {self.domains}")
        if min(self.steps, self.batch_size, self.seq_len, self.checkpoint_every) < 1:
            raise ValueError(f"steps, batch_size, seq_len, checkpoint_every must be >= 1: {self}")
        if self.batch_size < len(self.domains):
            raise ValueError(
                f"batch_size {self.batch_size} must be >= the number of domains {len(self.domains)}"
            )


@dataclass(frozen=True)
class Recipe:
    """Everything a build depends on."""

    scale: Scale
    corpus: CorpusRecipe
    tokenizer: TokenizerRecipe
    target: ModelRecipe
    draft: ModelRecipe
    target_train: TrainRecipe
    draft_train: TrainRecipe
    build_version: int = BUILD_VERSION
    python: str = field(default_factory=lambda: f"{sys.version_info[0]}.{sys.version_info[1]}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def stage_dict(self, stage: str) -> dict[str, Any]:
        """The part of the recipe a stage depends on directly (its inputs are hashed apart)."""
        parts = {
            "corpus": ("corpus",),
            "tokenizer": ("tokenizer",),
            "target": ("target", "target_train"),
            "draft": ("draft", "draft_train"),
        }[stage]
        common = {"build_version": self.build_version, "python": self.python}
        return common | {name: dataclasses.asdict(getattr(self, name)) for name in parts}

    @property
    def hash(self) -> str:
        """First 12 hex digits of the sha256 of the recipe as sorted JSON."""
        text = json.dumps(self.to_dict(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def _full() -> Recipe:
    # The generated domains are easy (held-out perplexity < 4 within a few hundred steps): most
    # of the target's tokens go to prose and code.
    # Chat dialogues answer with the same SQL, arithmetic, JSON and code, or call tools: 15 %.
    mixture = {"prose": 0.35, "code": 0.3, "sql": 0.1, "math": 0.1, "json": 0.1, "chat": 0.15}
    return Recipe(
        scale="full",
        corpus=CorpusRecipe(
            max_train_chars={
                "prose": 2_000_000,
                "code": 1_600_000,
                "sql": 500_000,
                "math": 500_000,
                "json": 500_000,
                "chat": 500_000,
            }
        ),
        tokenizer=TokenizerRecipe(vocab_size=4096),
        # Deep and narrow: on a CPU a decode step costs about the same per layer whatever the
        # width, so depth buys the target/draft cost ratio while width would only slow training.
        target=ModelRecipe(
            hidden_size=128, num_layers=12, num_heads=2, intermediate_size=352, max_positions=256
        ),
        draft=ModelRecipe(
            hidden_size=96, num_layers=1, num_heads=3, intermediate_size=256, max_positions=256
        ),
        target_train=TrainRecipe(
            domains=mixture, steps=800, batch_size=8, seq_len=256, lr=5e-3, warmup_steps=40
        ),
        draft_train=TrainRecipe(
            domains={"prose": 1.0}, steps=100, batch_size=16, seq_len=256, lr=3e-3, warmup_steps=10
        ),
    )


def _tiny() -> Recipe:
    mixture = {domain: 1.0 for domain in DOMAINS}
    return Recipe(
        scale="tiny",
        corpus=CorpusRecipe(
            max_train_chars=dict.fromkeys(DOMAINS, 12_000),
            num_heldout=6,
            max_doc_chars=1500,
            heldout_every=4,
            max_stdlib_files=24,
        ),
        tokenizer=TokenizerRecipe(vocab_size=320),
        target=ModelRecipe(
            hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_positions=128
        ),
        draft=ModelRecipe(
            hidden_size=16, num_layers=1, num_heads=1, intermediate_size=32, max_positions=128
        ),
        target_train=TrainRecipe(
            domains=mixture,
            steps=4,
            batch_size=6,
            seq_len=32,
            lr=1e-2,
            warmup_steps=1,
            checkpoint_every=2,
        ),
        draft_train=TrainRecipe(
            domains={"prose": 1.0},
            steps=4,
            batch_size=2,
            seq_len=32,
            lr=1e-2,
            warmup_steps=1,
            checkpoint_every=2,
        ),
    )


def recipe_for(scale: str) -> Recipe:
    """The recipe of a named scale: ``"full"`` (the demo pair) or ``"tiny"`` (tests, seconds)."""
    if scale == "full":
        return _full()
    if scale == "tiny":
        return _tiny()
    raise ValueError(f"scale must be 'tiny' or 'full', got {scale!r}")
