"""The trainer's model side: padding changes no estimate, and a candidate's weights compute the
same draft in a replica-shaped model as in the trainer."""

from __future__ import annotations

import torch

from osd.adapters.lora import install_adapter
from osd.adapters.manifest import AdapterManifest
from osd.config import ModelConfig
from osd.distill.acceptance import AcceptanceEstimate
from osd.model_sources import attach_lora_adapters
from tests.trainer.conftest import headroom_draft
from trainer.draft_trainer import DraftTrainer, peft_name

MODEL = ModelConfig(target="toy:target", draft="toy:draft", adapters=("general", "code"))


def new_trainer(eval_batch_records: int = 32) -> DraftTrainer:
    return DraftTrainer(
        headroom_draft(),
        MODEL,
        MODEL.adapters,
        base_model_id="toy",
        learning_rate=3e-3,
        eval_batch_records=eval_batch_records,
    )


def test_estimate_over_a_padded_batch_equals_the_per_record_estimates(records):
    sample = sorted(records[:6], key=lambda r: len(r.token_ids))
    assert len(sample[0].token_ids) < len(sample[-1].token_ids)  # really padded
    batched = new_trainer(eval_batch_records=6).estimate("general", "candidate", sample)
    one_by_one = AcceptanceEstimate.combine(
        new_trainer(eval_batch_records=1).estimate("general", "candidate", [r]) for r in sample
    )
    assert batched.num_positions == sum(r.num_generated for r in sample)
    assert abs(batched.lower - one_by_one.lower) < 1e-5
    assert abs(batched.upper - one_by_one.upper) < 1e-5


def test_steps_change_only_the_trained_adapters_candidate(records):
    trainer = new_trainer()
    before = {
        (a, s): trainer.weights(a, s) for a in ("general", "code") for s in ("candidate", "current")
    }
    for _ in range(3):
        trainer.train_step("general", records[:8], "all")
    changed = {
        key: any(not torch.equal(value, trainer.weights(*key)[name]) for name, value in old.items())
        for key, old in before.items()
    }
    assert changed == {
        ("general", "candidate"): True,
        ("general", "current"): False,
        ("code", "candidate"): False,
        ("code", "current"): False,
    }


def test_candidate_installed_in_a_replica_shaped_draft_computes_the_same_logits(records):
    trainer = new_trainer()
    for _ in range(3):
        trainer.train_step("general", records[:8], "all")
    manifest = AdapterManifest.create(
        name="general",
        version=1,
        spec=trainer.spec("general"),
        weights_sha256="0" * 64,
        num_weight_bytes=1,
        created_at=0.0,
        acceptance_estimate=None,
        parent_version=None,
    )
    replica = attach_lora_adapters(headroom_draft(), MODEL, ["general@0", "code@0"])
    install_adapter(replica, "general@1", manifest, trainer.weights("general"))
    input_ids = torch.from_numpy(records[0].token_ids.astype("int64"))[None]
    with torch.no_grad():
        replica.set_adapter("general@1")
        expected = replica(input_ids=input_ids).logits
        trainer.model.set_adapter(peft_name("general", "candidate"))
        actual = trainer.model(input_ids=input_ids).logits
        trainer.model.set_adapter(peft_name("general", "current"))
        untrained = trainer.model(input_ids=input_ids).logits
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(untrained, expected, atol=1e-3)
