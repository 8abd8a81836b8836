"""Training a demo language model: packed windows of domain streams, AdamW, resumable.

The batch of step ``s`` is drawn from a generator seeded by ``(seed, s)`` and there is no
dropout, so a run resumed from a checkpoint takes exactly the steps an uninterrupted run would.
Checkpoints are safetensors (weights and AdamW moments) plus a small JSON with the step and a
key of the run's inputs; a checkpoint with another key is ignored. Nothing is pickled.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, load_model, save_file, save_model
from transformers import LlamaConfig, LlamaForCausalLM

from osd.demo.progress import Progress
from osd.demo.recipe import ModelRecipe, TrainRecipe
from osd.threads import ThreadTuner

__all__ = [
    "TrainResult",
    "encode_streams",
    "new_model",
    "new_optimizer",
    "sample_batch",
    "train_model",
    "train_step",
]

_WEIGHTS, _OPTIMIZER, _STATE = "weights.safetensors", "optimizer.safetensors", "state.json"


@dataclass
class TrainResult:
    """What a training run did.

    Attributes:
        losses: training loss of every step, resumed steps included.
        resumed_from: the step a checkpoint was restored at (0: started fresh).
        seconds: wall time of this call (not of the steps before a resume).
    """

    losses: list[float]
    resumed_from: int
    seconds: float


def new_model(
    recipe: ModelRecipe, vocab_size: int, special_ids: Mapping[str, int], seed: int
) -> LlamaForCausalLM:
    """A freshly initialised ``LlamaForCausalLM`` (seeded)."""
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_heads,
        max_position_embeddings=recipe.max_positions,
        tie_word_embeddings=recipe.tie_embeddings,
        bos_token_id=special_ids["bos"],
        eos_token_id=special_ids["eos"],
        pad_token_id=special_ids["pad"],
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)


def encode_streams(tokenizer: Any, texts: Mapping[str, Sequence[str]]) -> dict[str, torch.Tensor]:
    """Concatenates each domain's documents as ``<|bos|> text <|endoftext|>`` token ids (a chat
    dialogue's text already ends with ``<|endoftext|>``, its last reply's end: not doubled).

    Returns:
        domain -> (N,) int64 token stream.
    """
    eos = tokenizer.eos_token_id
    streams = {}
    for domain, docs in texts.items():
        ids: list[int] = []
        for row in tokenizer(list(docs))["input_ids"]:
            ids.extend(row)
            if not row or row[-1] != eos:
                ids.append(eos)
        streams[domain] = torch.tensor(ids, dtype=torch.int64)
    return streams


def _domain_counts(shares: Mapping[str, float], batch_size: int) -> dict[str, int]:
    """Splits ``batch_size`` by the shares (largest remainder), at least one sequence each."""
    names = sorted(shares)
    total = sum(shares.values())
    extra = batch_size - len(names)
    exact = {d: shares[d] / total * extra for d in names}
    counts = {d: 1 + math.floor(exact[d]) for d in names}
    left = batch_size - sum(counts.values())
    for d in sorted(names, key=lambda d: exact[d] - math.floor(exact[d]), reverse=True)[:left]:
        counts[d] += 1
    return counts


def sample_batch(
    streams: Mapping[str, torch.Tensor], recipe: TrainRecipe, step: int
) -> torch.Tensor:
    """The batch of one step: (B, seq_len + 1) windows, a function of (seed, step) only."""
    gen = torch.Generator().manual_seed(recipe.seed * 1_000_003 + step)
    rows: list[torch.Tensor] = []
    for domain, count in _domain_counts(recipe.domains, recipe.batch_size).items():
        stream = streams[domain]
        if stream.numel() <= recipe.seq_len + 1:  # a tiny corpus: repeat it
            stream = stream.repeat(recipe.seq_len // max(stream.numel(), 1) + 2)
        starts = torch.randint(0, stream.numel() - recipe.seq_len - 1, (count,), generator=gen)
        rows.extend(stream[s : s + recipe.seq_len + 1] for s in starts.tolist())
    return torch.stack(rows)


def _learning_rate(recipe: TrainRecipe, step: int) -> float:
    if step < recipe.warmup_steps:
        return recipe.lr * (step + 1) / recipe.warmup_steps
    progress = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return recipe.lr * (recipe.min_lr_ratio + (1 - recipe.min_lr_ratio) * cosine)


def new_optimizer(model: torch.nn.Module, recipe: TrainRecipe) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on norms and biases)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": recipe.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=recipe.lr, betas=(0.9, 0.95), foreach=True)


def _save_checkpoint(
    directory: Path,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    key: str,
    losses: list[float],
) -> None:
    """Writes the checkpoint into a temporary folder, then swaps it in (never half-written)."""
    tmp = directory.with_name(directory.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    names: dict[torch.Tensor, str] = {p: name for name, p in model.named_parameters()}
    moments = {
        f"{names[param]}.{field}": value.detach().contiguous()
        for param, state in opt.state.items()
        for field, value in state.items()
    }
    save_model(model, str(tmp / _WEIGHTS))  # handles tied embeddings
    save_file(moments, tmp / _OPTIMIZER)
    (tmp / _STATE).write_text(json.dumps({"key": key, "step": len(losses), "losses": losses}))
    if directory.exists():
        for path in directory.iterdir():
            path.unlink()
        directory.rmdir()
    os.replace(tmp, directory)


def _load_checkpoint(
    directory: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, key: str
) -> list[float]:
    """Restores a checkpoint of the same run; returns its losses ([] when there is none)."""
    try:
        state = json.loads((directory / _STATE).read_text())
    except (OSError, ValueError):
        return []
    if state.get("key") != key:
        return []
    load_model(model, str(directory / _WEIGHTS))
    moments = load_file(directory / _OPTIMIZER)
    for name, param in model.named_parameters():
        fields = {k.rsplit(".", 1)[1]: v for k, v in moments.items() if k.rsplit(".", 1)[0] == name}
        if fields:
            opt.state[param] = fields
    return [float(x) for x in state["losses"]]


def train_step(
    model: LlamaForCausalLM,
    opt: torch.optim.Optimizer,
    batch: torch.Tensor,
    recipe: TrainRecipe,
    step: int,
) -> float:
    """One optimizer step of next-token loss on a (B, T + 1) batch; returns the loss."""
    for group in opt.param_groups:
        group["lr"] = _learning_rate(recipe, step)
    logits = model(input_ids=batch[:, :-1]).logits  # (B, T, V)
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def train_model(
    model: LlamaForCausalLM,
    streams: Mapping[str, torch.Tensor],
    recipe: TrainRecipe,
    *,
    checkpoint_dir: Path,
    key: str,
    progress: Progress,
    name: str,
    on_step: Callable[[int], None] | None = None,
    tune_threads: bool = False,
) -> TrainResult:
    """Trains ``model`` in place for ``recipe.steps`` steps, resuming from ``checkpoint_dir``.

    Args:
        model: the model to train.
        streams: domain -> token stream (see :func:`encode_streams`).
        recipe: the training schedule.
        checkpoint_dir: where resumable checkpoints live (kept until the caller removes them).
        key: identifies the run's inputs; a checkpoint with another key is ignored.
        progress: progress reporter.
        name: label for the progress output.
        on_step: called with the number of finished steps after each step (and checkpoint);
            tests use it to simulate an interruption.
        tune_threads: move between the current torch thread count and 1 by measured step
            times (:class:`osd.threads.ThreadTuner`: a busy neighbour makes 1 thread faster);
            the count in force before comes back at the end.
    """
    started = time.perf_counter()
    opt = new_optimizer(model, recipe)
    losses = _load_checkpoint(checkpoint_dir, model, opt, key)
    resumed_from = len(losses)
    model.train()
    bar = progress.training(name, recipe.steps, resumed_from, recipe.batch_size * recipe.seq_len)
    threads = torch.get_num_threads()
    tuner = ThreadTuner(
        (threads, 1 if tune_threads else threads),
        set_threads=torch.set_num_threads,
        on_switch=lambda old, new, was, now: progress.message(
            f"[osd demo-models] {name}: torch threads {old} -> {new} "
            f"({was:.2f} -> {now:.2f} s a step)"
        ),
    )
    try:
        for step in range(resumed_from, recipe.steps):
            batch = sample_batch(streams, recipe, step)  # (B, T + 1)
            tuner.before_step()
            started = time.perf_counter()
            losses.append(train_step(model, opt, batch, recipe, step))
            tuner.after_step(time.perf_counter() - started)
            bar.update(step + 1, losses[-1])
            if (step + 1) % recipe.checkpoint_every == 0 and step + 1 < recipe.steps:
                _save_checkpoint(checkpoint_dir, model, opt, key, losses)
            if on_step is not None:
                on_step(step + 1)
    finally:
        bar.close()
        model.eval()
        torch.set_num_threads(threads)
    return TrainResult(losses, resumed_from, time.perf_counter() - started)
