"""One adapter trained data parallel on several devices (`torch.distributed`).

A trainer given several devices (`trainer.devices`) runs one process per device. Rank 0, the
**leader**, is the worker of `trainer.worker` as with one device: it reads the log, judges,
publishes and owns every adapter's optimizer. Ranks 1.., the **followers**, only compute
gradients. A step of adapter `a` on records `R`:

1. the leader splits `R` into one shard per rank, balanced by tokens (`split_records`);
2. it broadcasts a header (the step, `a`, the step's trained positions `N`) and `a`'s candidate
   LoRA weights, so every follower computes with the leader's weights (no state to drift);
3. it sends each follower its shard, collated, point to point;
4. every rank runs its shard forward and backward with the loss scaled by `n_k / N` (its
   trained positions over the step's), so the shards' gradients add up to the gradient of the
   mean over all `N` positions: the one-device step's, up to the order of float additions;
5. the gradients are summed onto the leader (`reduce`), which clips them and steps.

The backend is NCCL when the devices are CUDA, gloo otherwise (tested on the CPU with gloo and
two processes). A follower that dies makes the leader's next step fail after `timeout_s` (the
process exits and its supervisor restarts the whole group); nothing is acknowledged for that step.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Sequence
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from osd.buffer.record import Record
from trainer.examples import Batch, PositionMode, collate


class ShardTrainer(Protocol):
    """What the group needs of a trainer (`trainer.draft_trainer.DraftTrainer` is one)."""

    adapters: list[str]

    @property
    def device(self) -> torch.device: ...

    def shard_backward(self, adapter: str, batch: Batch | None, total_positions: int) -> Tensor: ...

    def clip_and_step(self, adapter: str) -> None: ...

    def flat_candidate(self, adapter: str) -> Tensor: ...

    def set_flat_candidate(self, adapter: str, flat: Tensor) -> None: ...

    def flat_gradients(self, adapter: str) -> Tensor: ...

    def set_flat_gradients(self, adapter: str, flat: Tensor) -> None: ...


__all__ = ["DataParallel", "ShardTrainer", "backend_for", "flatten", "split_records"]

_log = logging.getLogger(__name__)
_STOP, _STEP = 0, 1
_HEADER = 4  # command, adapter index, trained positions of the step, spare


def backend_for(devices: Sequence[str]) -> str:
    """NCCL for CUDA devices, gloo for the CPU (one kind per group)."""
    kinds = {d.split(":")[0] for d in devices}
    if len(kinds) != 1:
        raise ValueError(f"trainer.devices mixes kinds of device: {list(devices)}")
    return "nccl" if kinds == {"cuda"} else "gloo"


def split_records(records: Sequence[Record], num_shards: int) -> list[list[Record]]:
    """`records` in `num_shards` shards of near-equal tokens (longest first, each to the shard
    with the fewest tokens so far); order within a shard follows `records`. A shard may be empty
    when there are fewer records than shards."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    loads, owner = [0] * num_shards, [0] * len(records)
    for i in sorted(range(len(records)), key=lambda i: -len(records[i].token_ids)):
        shard = min(range(num_shards), key=lambda s: (loads[s], s))
        owner[i] = shard
        loads[shard] += len(records[i].token_ids)
    return [[r for i, r in enumerate(records) if owner[i] == s] for s in range(num_shards)]


class DataParallel:
    """This process's place in a data-parallel group of trainer processes.

    Args:
        rank: 0 for the leader, 1.. for followers.
        world_size: processes in the group (devices).
        address: ``host:port`` of the leader's rendezvous (the same for every rank).
        backend: ``gloo`` or ``nccl`` (`backend_for`).
        timeout_s: how long a collective waits for a missing rank before it fails.
        device: this rank's device (a CUDA device becomes the process's current one).
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        address: str,
        backend: str,
        timeout_s: float = 300.0,
        device: str = "cpu",
    ) -> None:
        if world_size < 2 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} of {world_size}: need world_size >= 2, 0 <= rank")
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        if self.device.type == "cuda":  # NCCL: each rank on its own GPU before the group forms
            torch.cuda.set_device(self.device)
        self._broken = False  # a step failed half-way: the collectives no longer pair up
        dist.init_process_group(
            backend,
            init_method=f"tcp://{address}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        self._stopped = False

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    # The leader.

    def step(
        self, trainer: ShardTrainer, adapter: str, records: Sequence[Record], mode: PositionMode
    ) -> tuple[float, int, int]:
        """One optimizer step of `adapter`'s candidate, the records split over the group.

        Returns:
            (the step's mean loss, input tokens, trained positions), as one device's step.
        """
        self._broken = True  # until the step's last collective
        batches = [collate(s, mode) if s else None for s in split_records(records, self.world_size)]
        total = sum(b.num_train_positions for b in batches if b is not None)
        device = trainer.device
        header = [_STEP, trainer.adapters.index(adapter), total, 0]
        dist.broadcast(torch.tensor(header, dtype=torch.int64, device=device), src=0)
        dist.broadcast(trainer.flat_candidate(adapter), src=0)
        for rank, batch in enumerate(batches[1:], start=1):
            _send_batch(batch, rank, device)
        loss = trainer.shard_backward(adapter, batches[0], total)
        summed = torch.cat([trainer.flat_gradients(adapter), loss.detach().reshape(1)])
        dist.reduce(summed, dst=0)
        self._broken = False
        trainer.set_flat_gradients(adapter, summed[:-1])
        trainer.clip_and_step(adapter)
        tokens = sum(b.num_tokens for b in batches if b is not None)
        return float(summed[-1]), tokens, total

    def stop(self) -> None:
        """Tells the followers to exit and leaves the group (the leader's last call)."""
        if self._stopped:
            return
        self._stopped = True
        try:
            if self.is_leader and not self._broken:  # else the followers time out and exit
                stop = torch.tensor([_STOP, 0, 0, 0], dtype=torch.int64, device=self.device)
                dist.broadcast(stop, src=0)
        finally:
            dist.destroy_process_group()

    # A follower.

    def follow(self, trainer: ShardTrainer) -> int:
        """Computes its shard's gradients for every step the leader runs, until it stops.

        Returns:
            The number of steps taken part in.
        """
        device, steps = trainer.device, 0
        while True:
            header = torch.zeros(_HEADER, dtype=torch.int64, device=device)
            dist.broadcast(header, src=0)
            command, index, total, _ = (int(v) for v in header.tolist())
            if command == _STOP:
                self._stopped = True
                dist.destroy_process_group()
                return steps
            adapter = trainer.adapters[index]
            weights = trainer.flat_candidate(adapter)
            dist.broadcast(weights, src=0)
            trainer.set_flat_candidate(adapter, weights)
            loss = trainer.shard_backward(adapter, _recv_batch(device), total)
            summed = torch.cat([trainer.flat_gradients(adapter), loss.detach().reshape(1)])
            dist.reduce(summed, dst=0)
            steps += 1


def _send_batch(batch: Batch | None, rank: int, device: torch.device) -> None:
    """A shard to `rank`: its shape, then its tensors (no pickling: only numbers cross)."""
    if batch is None:
        dist.send(torch.zeros(4, dtype=torch.int64, device=device), dst=rank)
        return
    b, length, m = batch.target_top_ids.shape
    shape = torch.tensor([b, length, m, batch.first_index], dtype=torch.int64, device=device)
    dist.send(shape, dst=rank)
    ints = torch.stack([batch.input_ids, batch.attention_mask, batch.train_mask.long()])
    dist.send(ints.to(device), dst=rank)
    dist.send(batch.target_top_ids.long().to(device), dst=rank)
    dist.send(batch.target_top_probs.float().to(device), dst=rank)


def _recv_batch(device: torch.device) -> Batch | None:
    shape = torch.zeros(4, dtype=torch.int64, device=device)
    dist.recv(shape, src=0)
    b, length, m, first_index = (int(v) for v in shape.tolist())
    if b == 0:
        return None
    ints = torch.zeros(3, b, length, dtype=torch.int64, device=device)
    top_ids = torch.zeros(b, length, m, dtype=torch.int64, device=device)
    top_probs = torch.zeros(b, length, m, dtype=torch.float32, device=device)
    for tensor in (ints, top_ids, top_probs):
        dist.recv(tensor, src=0)
    train_mask = ints[2].bool()
    return Batch(ints[0], ints[1], top_ids, top_probs, train_mask, train_mask, first_index)


def flatten(tensors: Sequence[Tensor]) -> Tensor:
    """One flat fp32 copy of `tensors`, in order."""
    return torch.cat([t.detach().float().reshape(-1) for t in tensors])
