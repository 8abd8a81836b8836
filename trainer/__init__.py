"""The online distillation worker (docs/trainer.md): log records in, judged LoRA adapter versions
out. Thin over `osd`; nothing is imported here, so `import trainer.actor` stays light.

Modules: `worker` (`TrainerWorker`, the loop), `wiring` (`wire_trainer`: its parts from the
config), `adapter_state` (one adapter's windows and bookkeeping), `cli` (``osd train``), `actor`
(`TrainerService`, `trainer_actor` for Ray), `draft_trainer` (the peft draft, steps and
estimates), `examples` (routing, hold-out, positions, batches), `replay`, `judge`, `publisher`,
`tracking` (W&B), `worker_stats`.
"""
