"""Offline distillation of a draft LoRA adapter on one domain: the headroom online training chases.

The target (teacher) scores windows of the domain's training text; the draft (student) with a
fresh LoRA adapter learns to match the target's full next-token distribution under forward KL,
``sum_x p log(p / q)`` (docs/algorithms.md, "Distillation losses"; OSD's default). The online
trainer does the same from logged top-m distributions of live traffic; here the full distribution is
at hand.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from osd.demo.progress import Progress
from osd.demo.recipe import TrainRecipe
from osd.demo.training import _learning_rate, sample_batch

__all__ = ["DistillRecipe", "DistillResult", "distill_adapter", "forward_kl"]

LORA_MODULES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "embed_tokens",
    "lm_head",
)


@dataclass(frozen=True)
class DistillRecipe:
    """LoRA shape and schedule of one offline distillation.

    Attributes:
        steps, batch_size, seq_len, lr, warmup_steps: as in :class:`TrainRecipe`.
        rank: LoRA rank; ``alpha`` its scale numerator.
        target_modules: draft modules that get LoRA weights (the embeddings and output head
            too: a draft trained on prose has barely seen the new domain's tokens).
    """

    steps: int = 300
    batch_size: int = 8
    seq_len: int = 128
    lr: float = 3e-3
    warmup_steps: int = 20
    rank: int = 16
    alpha: int = 32
    target_modules: tuple[str, ...] = field(default=LORA_MODULES)
    seed: int = 0

    def schedule(self, domain: str) -> TrainRecipe:
        return TrainRecipe(
            domains={domain: 1.0},
            steps=self.steps,
            batch_size=self.batch_size,
            seq_len=self.seq_len,
            lr=self.lr,
            warmup_steps=self.warmup_steps,
            weight_decay=0.0,
            seed=self.seed,
        )


@dataclass
class DistillResult:
    """The draft with the new adapter (a peft model) and the per-step losses."""

    draft: Any
    losses: list[float]
    seconds: float


def forward_kl(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(p || q), softmax in fp32.

    Args:
        draft_logits: (N, V) student logits.
        target_logits: (N, V) teacher logits.
    """
    log_q = torch.log_softmax(draft_logits.float(), dim=-1)
    log_p = torch.log_softmax(target_logits.float(), dim=-1)
    return torch.nn.functional.kl_div(log_q, log_p, log_target=True, reduction="batchmean")


def _with_adapter(draft: Any, name: str, recipe: DistillRecipe) -> Any:
    from peft import LoraConfig, PeftModel, get_peft_model

    config = LoraConfig(
        r=recipe.rank, lora_alpha=recipe.alpha, target_modules=list(recipe.target_modules)
    )
    if isinstance(draft, PeftModel):
        if name in draft.peft_config:
            raise ValueError(f"the draft already has an adapter named {name!r}")
        draft.add_adapter(name, config)
    else:
        draft = get_peft_model(draft, config, adapter_name=name)
    draft.set_adapter(name)
    return draft


def distill_adapter(
    target: Any,
    draft: Any,
    streams: Mapping[str, torch.Tensor],
    domain: str,
    recipe: DistillRecipe | None = None,
    *,
    name: str | None = None,
    progress: Progress | None = None,
) -> DistillResult:
    """Adds a LoRA adapter to the draft and distills the target into it on one domain.

    Args:
        target: the target model (frozen).
        draft: the base draft, or a peft model that already has other adapters.
        streams: domain -> token stream (:func:`osd.demo.training.encode_streams`).
        domain: the domain to distill on.
        recipe: LoRA shape and schedule (defaults: :class:`DistillRecipe`).
        name: adapter name (default: the domain).
        progress: progress reporter (default: silent).
    """
    recipe = recipe or DistillRecipe()
    if domain not in streams:
        raise ValueError(f"no token stream for domain {domain!r}; have {sorted(streams)}")
    started = time.perf_counter()
    schedule = recipe.schedule(domain)
    with torch.random.fork_rng():
        torch.manual_seed(recipe.seed)  # LoRA's A matrices are random
        draft = _with_adapter(draft, name or domain, recipe)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=0.0)
    bar = (progress or Progress(False)).training(
        f"distill {name or domain}", recipe.steps, 0, recipe.batch_size * recipe.seq_len
    )
    losses: list[float] = []
    target.eval()
    draft.train()
    try:
        for step in range(recipe.steps):
            batch = sample_batch(streams, schedule, step)[:, :-1]  # (B, T)
            for group in opt.param_groups:
                group["lr"] = _learning_rate(schedule, step)
            with torch.no_grad():
                target_logits = target(input_ids=batch).logits  # (B, T, V)
            draft_logits = draft(input_ids=batch).logits  # (B, T, V)
            vocab = min(target_logits.shape[-1], draft_logits.shape[-1])
            loss = forward_kl(
                draft_logits[..., :vocab].flatten(0, 1), target_logits[..., :vocab].flatten(0, 1)
            )
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
            bar.update(step + 1, losses[-1])
    finally:
        bar.close()
        draft.eval()
    return DistillResult(draft, losses, time.perf_counter() - started)
