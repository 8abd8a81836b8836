"""Who joins the batch: pure admission decisions over counts, tested with tables.

Requests wait in arrival order; the head joins when the batch has room for one more sequence
and enough free KV slots for it (a SpecTr request needs one per draft sequence). The head is
never overtaken, so a large request cannot starve behind a stream of small ones.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BatchLimits", "kv_slots_for_memory", "num_to_admit"]


@dataclass(frozen=True)
class BatchLimits:
    """Capacity of one decode loop (vLLM's names where they mean the same).

    Attributes:
        max_num_seqs: requests decoded together in one step.
        max_num_batched_tokens: prompt tokens prefilled per step (longer prompts are chunked
            over several steps, so the rows already decoding are not stalled by a long prompt).
        kv_slots: rows of KV memory in each model's cache; 0: ``max_num_seqs``. A SpecTr
            request holds ``num_drafts`` of them.
        max_model_len: most positions of one sequence (prompt and output); 0: the models'.
        max_waiting: requests waiting for room; beyond it :meth:`submit` refuses at once.
        kv_cache_memory_bytes: with ``kv_slots`` 0, the KV memory both models' caches may take
            together: as many slots as fit (:func:`kv_slots_for_memory`); 0: no budget.
        fuse_prefill: a request joining rows that decode has its (short) prompt read in the
            step's target forward, beside their tokens, rather than in a forward of its own
            (:meth:`osd.decode.loop.BatchedEngine`; vLLM mixes prefills into decode steps
            alike); False (the default): every prompt gets its own prefill forward. Off by
            default: riding saved about 2 % of a 16-client measurement, and once its steps
            stopped counting against drafting, ``auto`` at 16 sampled rows read 0.78x the
            target alone with it against 0.86x without (``docs/benchmarks.md``).
        prefix_caching: a joining prompt that begins as a decoding row's or a free slot's last
            row's did (8 tokens or more) gets those positions' target KV copied rather than
            prefilled (:mod:`osd.decode.prefix_reuse`; vLLM's ``enable_prefix_caching``).
    """

    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    kv_slots: int = 0
    max_model_len: int = 0
    max_waiting: int = 64
    kv_cache_memory_bytes: int = 0
    fuse_prefill: bool = False
    prefix_caching: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("kv_slots", "max_model_len", "max_waiting", "kv_cache_memory_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @property
    def num_slots(self) -> int:
        return self.kv_slots or self.max_num_seqs


def kv_slots_for_memory(budget_bytes: int, bytes_per_slot: int, max_slots: int) -> int:
    """How many KV slots a memory budget holds (the cache's trash slot counted).

    Args:
        budget_bytes: memory the caches of both models may take.
        bytes_per_slot: one slot of both models at the longest sequence (max_len positions).
        max_slots: no more than this (slots beyond the rows and drafts a batch holds idle).

    Raises:
        ValueError: the budget does not hold one sequence.
    """
    if bytes_per_slot < 1:
        raise ValueError(f"bytes_per_slot must be >= 1, got {bytes_per_slot}")
    fits = budget_bytes // bytes_per_slot - 1  # one slot takes the padding writes
    if fits < 1:
        raise ValueError(
            f"a KV memory budget of {budget_bytes / 2**20:.1f} MiB holds no sequence "
            f"({bytes_per_slot / 2**20:.1f} MiB each at the longest length, plus one for "
            "padding): lower serve.max_model_len or give the KV cache more memory"
        )
    return min(fits, max_slots)


def num_to_admit(
    slots_needed: list[int], *, num_running: int, free_slots: int, max_num_seqs: int
) -> int:
    """How many of the waiting requests (in arrival order) join the batch now.

    Args:
        slots_needed: KV slots each waiting request needs, oldest first.
        num_running: requests in the batch (decoding or being prefilled).
        free_slots: KV slots free now.
        max_num_seqs: the batch's size limit.
    """
    admitted = 0
    for needed in slots_needed:
        if num_running + admitted >= max_num_seqs or needed > free_slots:
            break
        free_slots -= needed
        admitted += 1
    return admitted
