"""The build's cache: manifests, skipping, resuming stages and interrupted training."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from osd.demo import build_demo_models, default_cache_dir, demo_models_root, recipe_for
from osd.demo.build import STAGES, read_manifest, stage_is_complete


def _build(cache: Path, **kwargs):
    return build_demo_models(cache, "tiny", progress=False, num_threads=1, **kwargs)


def test_build_writes_every_stage_with_a_manifest(tiny_paths):
    recipe = recipe_for("tiny")
    assert tiny_paths.root.name == f"tiny-{recipe.hash}"
    assert tiny_paths.built_stages == STAGES
    for stage in STAGES:
        manifest = read_manifest(tiny_paths.root, stage)
        assert manifest is not None and manifest["recipe_hash"] == recipe.hash
        assert stage_is_complete(tiny_paths.root, stage, recipe)
    for model in (tiny_paths.target, tiny_paths.draft):
        assert (model / "model.safetensors").is_file()
        assert (model / "config.json").is_file()
        assert (model / "tokenizer.json").is_file()
        assert not list(model.glob("*.bin")) and not list(model.glob("*.pt"))
    assert not (tiny_paths.root / "checkpoints" / "target").exists()


def test_second_build_does_no_work(tiny_paths, tiny_cache):
    mtimes = {s: (tiny_paths.root / s / "manifest.json").stat().st_mtime_ns for s in STAGES}
    again = _build(tiny_cache)
    assert again.built_stages == ()
    assert again.root == tiny_paths.root
    assert mtimes == {s: (again.root / s / "manifest.json").stat().st_mtime_ns for s in STAGES}


def test_missing_manifest_rebuilds_only_that_stage(copy_cache):
    cache = copy_cache()
    root = demo_models_root(cache, "tiny")
    (root / "draft" / "manifest.json").unlink()
    assert _build(cache).built_stages == ("draft",)


def test_rebuilt_stage_with_identical_output_keeps_later_stages(copy_cache):
    cache = copy_cache()
    root = demo_models_root(cache, "tiny")
    before = read_manifest(root, "corpus")
    (root / "corpus" / "manifest.json").unlink()
    assert _build(cache).built_stages == ("corpus",)  # the corpus is deterministic
    assert read_manifest(root, "corpus")["output_hash"] == before["output_hash"]


def test_changed_input_invalidates_the_stages_that_read_it(copy_cache):
    cache = copy_cache()
    root = demo_models_root(cache, "tiny")
    manifest = read_manifest(root, "tokenizer")
    manifest["output_hash"] = "0" * 64
    (root / "tokenizer" / "manifest.json").write_text(json.dumps(manifest))
    assert not stage_is_complete(root, "target", recipe_for("tiny"))
    assert _build(cache).built_stages == ("target", "draft")


def test_truncated_output_file_invalidates_the_stage(copy_cache):
    cache = copy_cache()
    root = demo_models_root(cache, "tiny")
    weights = root / "target" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    assert _build(cache).built_stages == ("target",)


def test_stop_after_stage_then_a_full_build_does_the_rest(tmp_path):
    first = _build(tmp_path, stop_after_stage="tokenizer")
    assert first.built_stages == ("corpus", "tokenizer")
    assert not (first.root / "target").exists()
    assert _build(tmp_path).built_stages == ("target", "draft")


def test_force_rebuilds_every_stage(copy_cache):
    assert _build(copy_cache(), force=True).built_stages == STAGES


def test_interrupted_training_resumes_from_its_checkpoint_with_identical_weights(
    tmp_path, tiny_paths
):
    class Interrupted(Exception):
        pass

    def interrupt(stage: str, step: int) -> None:
        if stage == "target" and step == 3:  # checkpoint_every is 2: step 2 was saved
            raise Interrupted

    with pytest.raises(Interrupted):
        _build(tmp_path, on_train_step=interrupt)
    root = demo_models_root(tmp_path, "tiny")
    state = json.loads((root / "checkpoints" / "target" / "state.json").read_text())
    assert state["step"] == 2
    assert not (root / "target").exists()

    resumed = _build(tmp_path)
    assert resumed.built_stages == ("target", "draft")
    assert read_manifest(root, "target")["info"]["resumed_from_step"] == 2
    weights = load_file(resumed.target / "model.safetensors")
    reference = load_file(tiny_paths.target / "model.safetensors")
    assert weights.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=0)


def test_checkpoint_of_another_recipe_is_ignored(tmp_path):
    def interrupt(stage: str, step: int) -> None:
        if stage == "target" and step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _build(tmp_path, on_train_step=interrupt)
    root = demo_models_root(tmp_path, "tiny")
    state_path = root / "checkpoints" / "target" / "state.json"
    state = json.loads(state_path.read_text())
    state_path.write_text(json.dumps(state | {"key": "another run"}))
    _build(tmp_path)
    assert read_manifest(root, "target")["info"]["resumed_from_step"] == 0


def test_default_cache_dir_follows_osd_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("OSD_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path / "demo-models"
    assert demo_models_root(None, "tiny").parent == tmp_path / "demo-models"
    monkeypatch.delenv("OSD_CACHE_DIR")
    assert default_cache_dir() == Path.home() / ".cache" / "osd" / "demo-models"


def test_recipe_hash_changes_with_any_setting():
    recipe = recipe_for("tiny")
    changed = dataclasses.replace(
        recipe, draft_train=dataclasses.replace(recipe.draft_train, lr=0.5)
    )
    assert changed.hash != recipe.hash
    assert recipe_for("tiny").hash == recipe.hash
    assert recipe_for("full").hash != recipe.hash


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"scale": "huge"}, "scale must be"),
        ({"scale": "tiny", "stop_after_stage": "weights"}, "stop_after_stage"),
    ],
)
def test_bad_build_arguments_raise(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_demo_models(tmp_path, progress=False, **kwargs)
