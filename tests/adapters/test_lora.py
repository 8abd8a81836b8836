"""LoRA weights in and out of peft models, and the base-model hash."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from osd.adapters import open_adapter_store
from osd.adapters.lora import (
    adapter_spec,
    base_model_hash,
    install_adapter,
    lora_shapes,
    lora_state_dict,
)
from osd.testing import with_lora_adapters
from osd.versions.errors import VersionIntegrityError

from .conftest import BASE_MODEL_ID, tiny_base

INPUT_IDS = torch.tensor([[1, 5, 9, 2, 7]])


def _logits(model, adapter: str) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=INPUT_IDS, adapter_names=[adapter]).logits


def test_base_model_hash_is_stable_and_ignores_adapters_and_dtype(trainer_draft):
    plain = tiny_base()
    assert base_model_hash(plain) == base_model_hash(tiny_base())
    assert base_model_hash(trainer_draft) == base_model_hash(plain)
    assert base_model_hash(copy.deepcopy(plain).to(torch.bfloat16)) == base_model_hash(plain)


@pytest.mark.parametrize(
    "other",
    [lambda: tiny_base(seed=1), lambda: tiny_base(hidden_size=48)],
    ids=["other-weights", "other-config"],
)
def test_base_model_hash_tells_foreign_bases_apart(other):
    assert base_model_hash(other()) != base_model_hash(tiny_base())


def test_base_model_hash_sees_a_single_changed_weight_row():
    # Negative control for "stable": a fine-tuned base (one edited embedding) is a new base.
    edited = tiny_base()
    with torch.no_grad():
        edited.model.embed_tokens.weight[0] += 1.0
    assert base_model_hash(edited) != base_model_hash(tiny_base())


def test_spec_describes_the_adapter(trainer_draft, spec):
    assert (spec.rank, spec.lora_alpha, spec.target_modules) == (4, 8.0, ("q_proj", "v_proj"))
    assert spec.base_model_id == BASE_MODEL_ID
    with pytest.raises(ValueError, match="unknown adapter 'nope'"):
        adapter_spec(trainer_draft, "nope", BASE_MODEL_ID)


def test_spec_refuses_lora_options_the_manifest_cannot_carry():
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], use_rslora=True)
    model = get_peft_model(tiny_base(), config, adapter_name="rs")
    with pytest.raises(ValueError, match="use_rslora"):
        adapter_spec(model, "rs", BASE_MODEL_ID)


def test_state_dict_keys_do_not_name_the_adapter(trainer_draft, code_weights):
    assert all(".code." not in key for key in code_weights)
    assert {key: tuple(v.shape) for key, v in code_weights.items()} == lora_shapes(
        trainer_draft, "code"
    )


def test_published_adapter_installs_in_a_replica_and_computes_the_same_logits(
    tmp_path, trainer_draft, spec, code_weights
):
    store = open_adapter_store(tmp_path)
    store.publish("code", code_weights, spec=spec, expected_current=None)

    replica = with_lora_adapters(tiny_base(), ["general"], seed=5)
    manifest, weights = store.load(
        "code",
        store.current("code"),
        expected_base_model_hash=base_model_hash(replica),
        expected_shapes=lora_shapes(replica, "general"),
    )
    base_before = _logits(replica, "__base__")
    install_adapter(replica, "code-v1", manifest, weights)

    torch.testing.assert_close(
        _logits(replica, "code-v1"), _logits(trainer_draft, "code"), rtol=1e-5, atol=1e-6
    )
    assert not torch.allclose(_logits(replica, "code-v1"), _logits(replica, "general"))
    torch.testing.assert_close(_logits(replica, "__base__"), base_before, rtol=0, atol=0)
    assert replica.active_adapters == ["general"]
    assert not any(p.requires_grad for n, p in replica.named_parameters() if ".code-v1." in n)


def test_install_refuses_without_leaving_a_half_installed_adapter(tmp_path, spec, code_weights):
    store = open_adapter_store(tmp_path)
    store.publish("code", code_weights, spec=spec, expected_current=None)
    manifest, weights = store.load("code", 1, expected_base_model_hash=None)
    replica = with_lora_adapters(tiny_base(), ["general"], seed=5)

    with pytest.raises(ValueError, match="already exists"):
        install_adapter(replica, "general", manifest, weights)
    with pytest.raises(VersionIntegrityError, match="expected"):
        install_adapter(replica, "wide", replace(manifest, rank=8), weights)
    foreign = with_lora_adapters(tiny_base(seed=3), ["general"], seed=5)
    with pytest.raises(VersionIntegrityError, match="another base model"):
        install_adapter(foreign, "code-v1", manifest, weights)
    assert sorted(replica.peft_config) == ["general"]
    assert sorted(foreign.peft_config) == ["general"]


def test_installed_adapter_can_be_made_trainable(spec, code_weights, tmp_path):
    store = open_adapter_store(tmp_path)
    store.publish("code", code_weights, spec=spec, expected_current=None)
    manifest, weights = store.load("code", 1, expected_base_model_hash=spec.base_model_hash)
    model = with_lora_adapters(tiny_base(), ["general"], seed=5)
    install_adapter(model, "code-v1", manifest, weights, trainable=True)
    assert all(p.requires_grad for n, p in model.named_parameters() if ".code-v1." in n)
    torch.testing.assert_close(lora_state_dict(model, "code-v1"), dict(weights))


def _lm_head_draft(seed: int):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], init_lora_weights=False
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return get_peft_model(tiny_base(), config, adapter_name="general").eval()


def test_versions_carry_lora_tensors_only_not_the_base_lm_head(tmp_path):
    trained, replica = _lm_head_draft(seed=1), _lm_head_draft(seed=2)
    weights = lora_state_dict(trained, "general")
    assert all(".lora_A." in key or ".lora_B." in key for key in weights)
    assert any("lm_head.lora_B" in key for key in weights)
    spec = adapter_spec(trained, "general", BASE_MODEL_ID)
    # A version stored before carries the base lm_head too: it still loads, without it.
    base_copy = "base_model.model.lm_head.base_layer.weight"
    lm_head = trained.get_output_embeddings().base_layer.weight
    store = open_adapter_store(tmp_path)
    store.publish("general", weights, spec=spec, expected_current=None)
    store.publish(
        "general", {**weights, base_copy: lm_head.detach()}, spec=spec, expected_current=1
    )
    shapes = lora_shapes(replica, "general")
    slim, fat = (store.manifest("general", v).num_weight_bytes for v in (1, 2))
    assert fat - slim >= lm_head.numel() * 4
    for version in (1, 2):
        manifest, loaded = store.load(
            "general", version, expected_base_model_hash=None, expected_shapes=shapes
        )
        install_adapter(replica, f"general-v{version}", manifest, loaded)
        torch.testing.assert_close(
            _logits(replica, f"general-v{version}"),
            _logits(trained, "general"),
            rtol=1e-5,
            atol=1e-6,
        )
