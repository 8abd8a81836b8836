"""osd: online speculative decoding.

Lossless speculative decoding (token, block and SpecTr verification) over Hugging Face models,
with drafts distilled online from the target's logged distributions. See README.md.
"""

from osd.engine import SpeculativeDecoder
from osd.generation import GenerationLog, GenerationResult, GenerationStats, StreamChunk
from osd.sampling import SamplingParams

__all__ = [
    "GenerationLog",
    "GenerationResult",
    "GenerationStats",
    "SamplingParams",
    "SpeculativeDecoder",
    "StreamChunk",
]
