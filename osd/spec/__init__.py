"""The batched speculative decoding core: one decode loop steps every in-flight request.

Owns: counter-based random streams (``rng``), the per-row KV slot cache (``kv_cache``), the
per-request row state (``rows``), admission decisions (``scheduler``), the batched step that
drafts, verifies and emits for all rows at once (``step``) and the loop thread that runs it
(``loop``). May import torch, transformers and the pure core (``osd.sampling``,
``osd.verification``, ``osd.generation``, ``osd.models``); never Redis, Ray, HTTP or files.
"""
