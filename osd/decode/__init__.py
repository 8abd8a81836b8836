"""Speculative decoding: draft, verify exactly, emit; every in-flight request in one batched step.

Owns, pure: sampling a token from logits under every OpenAI option (``sampling``, with the
penalties' view of a prefix in ``prefix_history``), the lossless verifiers (``verification``),
what a generation returns (``generation``) and a request's checks (``request_checks``).
Owns, on the decode path: grammars compiled to token masks (``grammar``, applied by
``grammar_masks``), counter-based random streams (``rng``), the per-row KV slot cache
(``kv_cache``), per-request row state (``rows``), admission (``scheduler``), the batched step that
drafts, verifies and emits for all rows at once (``step``), the loop thread that runs it
(``loop``) and the engine that takes requests (``engine``), the models it runs (``models``,
``lean_forward``) and the names of its methods (``methods``). May import torch and
transformers; never Redis, Ray, HTTP, files, the stores or the config. Finished requests leave
as ``GenerationLog``s, which serving turns into log records (``osd.buffer``).
"""
