"""The base draft with LoRA adapters being distilled, and their acceptance estimates.

Each logical adapter (``general``, ``code``, ...) has two peft adapters on one base draft:
``<name>@candidate``, trained by the optimizer, and ``<name>@current``, frozen, holding the
version the store names as current (identity LoRA, i.e. the base draft, before any version).
Both use exactly the LoRA layout of the replicas (`osd.model_sources.attach_lora_adapters` with
`config.model`), so a candidate's `lora_state_dict` loads into a replica's ``<name>@<version>``.

Training runs under `accelerate` (fp32 on CPU, bf16 autocast on CUDA); the losses
(`osd.distill.losses.distillation_loss`) and estimates
(`osd.distill.acceptance.estimate_acceptance`) compute their softmax in fp32 either way.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from osd.adapters.lora import adapter_spec, check_lora_shapes, lora_shapes, lora_state_dict
from osd.adapters.manifest import AdapterSpec
from osd.buffer.record import Record
from osd.config import ModelConfig, OSDConfig, resolve_device
from osd.distill.acceptance import AcceptanceEstimate, acceptance_bounds, estimate_acceptance
from osd.distill.losses import LossName, distillation_loss
from osd.model_sources import attach_lora_adapters, load_draft
from trainer.data_parallel import DataParallel, flatten
from trainer.examples import Batch, PositionMode, collate

__all__ = ["DraftTrainer", "Slot", "StepStats", "build_draft_trainer", "peft_name"]

Slot = Literal["candidate", "current"]


@dataclass(frozen=True)
class StepStats:
    """What one optimizer step did.

    Attributes:
        loss: the loss before the step (mean over the trained positions; 0 with none).
        num_tokens: real input tokens run through the draft (forward and backward).
        num_positions: positions the loss counted.
    """

    loss: float
    num_tokens: int
    num_positions: int


def peft_name(adapter: str, slot: Slot) -> str:
    """The peft adapter holding `slot` of logical adapter `adapter`."""
    return f"{adapter}@{slot}"


class DraftTrainer:
    """Trains and evaluates the LoRA adapters of one base draft.

    Args:
        draft: the base draft (a plain Hugging Face causal LM, not yet wrapped by peft).
        model_config: the model section; its LoRA rank, alpha and target modules are used.
        adapters: logical adapter names, general first.
        base_model_id: what published manifests name as the base draft.
        loss: distillation loss (`osd.distill.losses.LossName`).
        learning_rate: AdamW learning rate of every candidate.
        device: "cpu" or "cuda[:i]"; CUDA trains with bf16 autocast.
        vocab_size: draft logits columns the engine scores (padded rows beyond are cut); None:
            all of them.
        eval_batch_records: records per forward when estimating acceptance.
        max_grad_norm: gradient clipping threshold.
        seed: seeds the LoRA initialisation (the global torch RNG is left as it was).
        data_parallel: the group this trainer leads or follows (`trainer.data_parallel`), None
            for one device.
    """

    def __init__(
        self,
        draft: Any,
        model_config: ModelConfig,
        adapters: Sequence[str],
        *,
        base_model_id: str,
        loss: LossName = "forward_kl",
        learning_rate: float = 1e-3,
        device: str = "cpu",
        vocab_size: int | None = None,
        eval_batch_records: int = 32,
        max_grad_norm: float = 1.0,
        seed: int = 0,
        data_parallel: DataParallel | None = None,
    ) -> None:
        from accelerate import Accelerator

        if not adapters:
            raise ValueError("adapters must name at least one adapter")
        self.adapters = list(adapters)
        self.base_model_id, self.loss = base_model_id, loss
        self.vocab_size, self.eval_batch_records = vocab_size, eval_batch_records
        self.max_grad_norm = max_grad_norm
        # Only the leader splits steps; a follower's steps come from `DataParallel.follow`.
        self.data_parallel = data_parallel if data_parallel and data_parallel.is_leader else None
        names = [peft_name(a, s) for s in ("candidate", "current") for a in self.adapters]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = attach_lora_adapters(draft, model_config, names)
        on_cuda = device.startswith("cuda")
        self.accelerator = Accelerator(cpu=not on_cuda, mixed_precision="bf16" if on_cuda else "no")
        optimizers = [
            torch.optim.AdamW(self._lora_params(model, peft_name(a, "candidate")), learning_rate)
            for a in self.adapters
        ]
        model, *prepared = self.accelerator.prepare(model, *optimizers)
        self.model = model
        self._optimizers = dict(zip(self.adapters, prepared, strict=True))
        forward = self.model.get_base_model().forward
        self._slices_logits = "logits_to_keep" in inspect.signature(forward).parameters
        self.model.eval()

    @staticmethod
    def _lora_params(model: Any, name: str) -> list[Tensor]:
        params = [p for n, p in model.named_parameters() if f".{name}." in n]
        if not params:
            raise ValueError(f"peft adapter {name!r} has no parameters")
        return params

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    def _logits(self, adapter: str, slot: Slot, batch: Batch) -> Tensor:
        """(B, L - first_index, V) draft logits at the inputs that predict generated tokens."""
        self.model.set_adapter(peft_name(adapter, slot))
        kwargs: dict[str, Any] = {"use_cache": False}
        keep = batch.input_ids.shape[1] - batch.first_index
        if self._slices_logits:
            kwargs["logits_to_keep"] = keep
        with self.accelerator.autocast():
            logits = self.model(
                input_ids=batch.input_ids, attention_mask=batch.attention_mask, **kwargs
            ).logits
        logits = logits[:, -keep:]
        return logits if self.vocab_size is None else logits[..., : self.vocab_size]

    def train_step(
        self, adapter: str, records: Sequence[Record], positions: PositionMode
    ) -> StepStats:
        """One optimizer step of `adapter`'s candidate on `records`, at `positions`; split over
        the group's devices when the trainer leads a data-parallel group."""
        if self.data_parallel is not None:
            return StepStats(*self.data_parallel.step(self, adapter, records, positions))
        batch = collate(records, positions)
        loss = self.shard_backward(adapter, batch, batch.num_train_positions)
        self.clip_and_step(adapter)
        return StepStats(float(loss.detach()), batch.num_tokens, batch.num_train_positions)

    def shard_backward(self, adapter: str, batch: Batch | None, total_positions: int) -> Tensor:
        """Clears `adapter`'s gradients, then backpropagates the loss of `batch` (None: nothing)
        scaled by its share of the step's `total_positions` (1 when it is the whole step).

        Returns:
            The scaled loss: summed over a step's shards, the mean over all its positions.
        """
        self._optimizers[adapter].zero_grad(set_to_none=True)
        if batch is None:
            return torch.zeros((), device=self.device)
        batch = batch.to(self.device)
        share = batch.num_train_positions / total_positions if total_positions else 0.0
        self.model.train()
        try:
            logits = self._logits(adapter, "candidate", batch)
            top_ids, top_probs, train_mask, _ = batch.sliced()
            loss = distillation_loss(self.loss, logits, top_ids, top_probs, train_mask)
            loss = loss if share == 1.0 else loss * share
            self.accelerator.backward(loss)
        finally:
            self.model.eval()
        return loss

    def clip_and_step(self, adapter: str) -> None:
        """Clips `adapter`'s candidate gradients at `max_grad_norm` and steps its optimizer."""
        params = self._lora_params(self.model, peft_name(adapter, "candidate"))
        self.accelerator.clip_grad_norm_(params, self.max_grad_norm)
        self._optimizers[adapter].step()

    def flat_candidate(self, adapter: str) -> Tensor:
        """`adapter`'s candidate LoRA weights as one flat fp32 tensor on the trainer's device."""
        return flatten(self._lora_params(self.model, peft_name(adapter, "candidate")))

    @torch.no_grad()
    def set_flat_candidate(self, adapter: str, flat: Tensor) -> None:
        """Loads `flat_candidate`'s layout back into `adapter`'s candidate."""
        offset = 0
        for param in self._lora_params(self.model, peft_name(adapter, "candidate")):
            param.copy_(flat[offset : offset + param.numel()].view_as(param))
            offset += param.numel()

    def flat_gradients(self, adapter: str) -> Tensor:
        """`adapter`'s candidate gradients, flat as `flat_candidate` (zeros where none)."""
        params = self._lora_params(self.model, peft_name(adapter, "candidate"))
        return flatten([p.grad if p.grad is not None else torch.zeros_like(p) for p in params])

    def set_flat_gradients(self, adapter: str, flat: Tensor) -> None:
        """Sets `adapter`'s candidate gradients from `flat_gradients`' layout."""
        offset = 0
        for param in self._lora_params(self.model, peft_name(adapter, "candidate")):
            part = flat[offset : offset + param.numel()].view_as(param)
            param.grad = part.to(param.dtype).clone()
            offset += param.numel()

    def _evaluated(
        self, adapter: str, slot: Slot, records: Sequence[Record]
    ) -> Iterator[tuple[Tensor, Tensor, Tensor, Tensor]]:
        """`(logits, target_top_ids, target_top_probs, eval_mask)` of `slot` of `adapter`, a
        chunk of `eval_batch_records` records at a time (under `torch.no_grad` of the caller)."""
        for start in range(0, len(records), self.eval_batch_records):
            chunk = records[start : start + self.eval_batch_records]
            batch = collate(chunk, "all").to(self.device)
            logits = self._logits(adapter, slot, batch).float()
            top_ids, top_probs, _, eval_mask = batch.sliced()
            yield logits, top_ids, top_probs, eval_mask

    @torch.no_grad()
    def estimate(self, adapter: str, slot: Slot, records: Sequence[Record]) -> AcceptanceEstimate:
        """Mean acceptance bounds of `slot` of `adapter` over every generated position of
        `records` (`osd.distill.acceptance.estimate_acceptance`); trivial [0, 1] with no records."""
        parts = [estimate_acceptance(*chunk) for chunk in self._evaluated(adapter, slot, records)]
        return AcceptanceEstimate.combine(parts)

    @torch.no_grad()
    def record_acceptance(self, adapter: str, slot: Slot, records: Sequence[Record]) -> list[float]:
        """Each record's mean acceptance lower bound under `slot` of `adapter` (what the content
        router's labels compare across adapters)."""
        out: list[float] = []
        for logits, top_ids, top_probs, eval_mask in self._evaluated(adapter, slot, records):
            lower, _ = acceptance_bounds(logits, top_ids, top_probs)  # (B, T)
            mask = eval_mask.float()
            out.extend((lower * mask).sum(-1).div(mask.sum(-1).clamp(min=1)).tolist())
        return out

    def weights(self, adapter: str, slot: Slot = "candidate") -> dict[str, Tensor]:
        """CPU copies of one slot's LoRA tensors, keyed as the store and replicas expect."""
        return lora_state_dict(self.model, peft_name(adapter, slot))

    def shapes(self, adapter: str) -> dict[str, tuple[int, ...]]:
        """The LoRA layout (key -> shape) every version of `adapter` must have."""
        return lora_shapes(self.model, peft_name(adapter, "candidate"))

    def spec(self, adapter: str) -> AdapterSpec:
        """What a published version of `adapter` is: base draft, rank, alpha, target modules."""
        return adapter_spec(self.model, peft_name(adapter, "candidate"), self.base_model_id)

    @torch.no_grad()
    def set_weights(
        self, adapter: str, weights: Mapping[str, Tensor], slots: Iterable[Slot]
    ) -> None:
        """Copies `weights` (keyed like `weights()`) into the given slots of `adapter`.

        Raises:
            VersionIntegrityError: keys or shapes that are not this adapter's layout.
        """
        from peft import set_peft_model_state_dict

        check_lora_shapes(weights, self.shapes(adapter))
        for slot in slots:
            name = peft_name(adapter, slot)
            state = {k: v.to(self.device) for k, v in weights.items()}
            set_peft_model_state_dict(self.model, state, adapter_name=name)

    def reset_to_base(self, adapter: str) -> None:
        """Makes both slots of `adapter` the base draft again (LoRA B = 0) and forgets the
        optimizer's moments: after a rollback past the first version, training starts over."""
        base = {
            key: torch.zeros_like(value) if "lora_B" in key else value
            for key, value in self.weights(adapter, "current").items()
        }
        self.set_weights(adapter, base, ["candidate", "current"])
        optimizer = self._optimizers[adapter]
        getattr(optimizer, "optimizer", optimizer).state.clear()

    def promote(self, adapter: str) -> None:
        """Makes the candidate the current version (after it was published)."""
        self.set_weights(adapter, self.weights(adapter, "candidate"), ["current"])


def build_draft_trainer(
    config: OSDConfig,
    adapters: Sequence[str],
    draft: Any = None,
    base_model_id: str | None = None,
    data_parallel: DataParallel | None = None,
) -> DraftTrainer:
    """The trainer's draft in fp32 (bf16 autocast on CUDA) with `adapters`, set up as the
    `trainer` section says (loss, learning rate, device, seed); `draft` defaults to the
    configured base draft. In a data-parallel group each rank takes its own of
    `trainer.devices`."""
    cfg = config.trainer
    if data_parallel is not None and cfg.devices:
        device = cfg.devices[data_parallel.rank]
    else:
        device = resolve_device(cfg.device)
    if draft is None:
        draft, source = load_draft(config.model, device=device, dtype="float32")
        base_model_id = base_model_id or source
    return DraftTrainer(
        draft.float(),
        config.model,
        adapters,
        base_model_id=base_model_id or config.model.draft,
        loss=cfg.loss,
        learning_rate=cfg.learning_rate,
        device=device,
        eval_batch_records=cfg.batch_records,
        seed=cfg.seed,
        data_parallel=data_parallel,
    )
