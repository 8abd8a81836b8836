"""The bounds of one request's decoding options, named once: the engine's checks
(osd.decode.request_checks), the config's (osd.config) and the HTTP API's (serving.protocol) all
read them here. Pure constants: importing this module loads nothing else.
"""

from __future__ import annotations

__all__ = [
    "HTTP_MAX_DRAFTS",
    "HTTP_MAX_SPEC_TOKENS",
    "MAX_DRAFTS",
    "MAX_LOGPROBS",
    "MAX_SPEC_TOKENS",
]

# What the engine can decode: a step's random draws are addressed by (branch, position) in 10
# bits each (osd.decode.rng), far above these.
MAX_SPEC_TOKENS = 64  # k, drafted tokens per step
MAX_DRAFTS = 64  # K, SpecTr's draft sequences (each holds a KV slot)
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's chat top_logprobs

# What one HTTP request may ask of a shared replica: a request's K slots and k-token drafts
# come out of the batch every other request shares.
HTTP_MAX_SPEC_TOKENS = 16
HTTP_MAX_DRAFTS = 8
