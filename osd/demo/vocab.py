"""The demo tokenizer: byte-level BPE trained on the corpus, saved as a PreTrainedTokenizerFast.

Byte-level means every string round-trips, whatever the traffic. Ids 0, 1, 2 are the special
tokens ``<|endoftext|>`` (EOS, ends every training document and every assistant reply),
``<|bos|>`` (prepended to every encoded text, so a prompt looks like the start of a training
document) and ``<|pad|>``; ids 3, 4, 5 the chat template's role markers ``<|system|>``,
``<|user|>`` and ``<|assistant|>``. The tokenizer carries the chat template
(:data:`osd.demo.chat.CHAT_TEMPLATE`), so ``apply_chat_template`` renders chat prompts as the
corpus's dialogues.
"""

from __future__ import annotations

from collections.abc import Iterable

from transformers import PreTrainedTokenizerFast

from osd.demo.chat import CHAT_TEMPLATE
from osd.demo.recipe import (
    BOS_TOKEN,
    EOS_TOKEN,
    PAD_TOKEN,
    ROLE_TOKENS,
    SPECIAL_TOKENS,
    TokenizerRecipe,
)

__all__ = ["train_tokenizer"]


def train_tokenizer(texts: Iterable[str], recipe: TokenizerRecipe) -> PreTrainedTokenizerFast:
    """Trains a byte-level BPE tokenizer.

    Args:
        texts: training documents (all domains).
        recipe: vocabulary size and merge frequency threshold.

    Returns:
        A fast tokenizer whose encodings start with ``<|bos|>``; ``eos_token`` ends documents;
        ``chat_template`` set.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=recipe.vocab_size,
        min_frequency=recipe.min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=list(ROLE_TOKENS),
        model_max_length=1_000_000,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast
