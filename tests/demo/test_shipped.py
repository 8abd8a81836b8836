"""The shipped demo pair (osd.demo.shipped): packed from a build, installed on a fresh cache in
place of the build, its weights the build's within float16 rounding; an archive that fails its
check installs nothing and the build runs; the pair shipped in the package matches the recipe."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from osd.demo import build_demo_models, recipe_for
from osd.demo.build import STAGES, stage_is_complete
from osd.demo.shipped import SHIPPED_DIR, archive_name, install_shipped, pack


def test_a_packed_pair_installs_instead_of_building(tiny_paths, tmp_path):
    recipe = recipe_for("tiny")
    shipped = tmp_path / "shipped"
    archive = pack(tiny_paths.root, "tiny", recipe.hash, shipped)
    description = json.loads((shipped / f"{archive_name('tiny', recipe.hash)}.json").read_text())
    assert description["archive"] == archive.name and description["weights"] == "float16"

    fresh = build_demo_models(tmp_path / "cache", "tiny", progress=False, shipped_dir=shipped)
    assert fresh.built_stages == ()  # installed, nothing trained
    for stage in STAGES:
        assert stage_is_complete(fresh.root, stage, recipe)
    for model in ("target", "draft"):
        built = load_file(str(tiny_paths.root / model / "model.safetensors"))
        installed = load_file(str(fresh.root / model / "model.safetensors"))
        assert built.keys() == installed.keys()
        for name, tensor in built.items():
            assert installed[name].dtype == tensor.dtype == torch.float32
            torch.testing.assert_close(installed[name], tensor.half().float())
    # The corpus and tokenizer are the build's, byte for byte.
    for name in ("corpus/sql/heldout.jsonl", "tokenizer/tokenizer.json"):
        assert (fresh.root / name).read_bytes() == (tiny_paths.root / name).read_bytes()


def test_a_tampered_archive_installs_nothing_and_the_build_runs(tiny_paths, tmp_path):
    recipe = recipe_for("tiny")
    shipped = tmp_path / "shipped"
    archive = pack(tiny_paths.root, "tiny", recipe.hash, shipped)
    data = bytearray(archive.read_bytes())
    data[len(data) // 2] ^= 0xFF
    archive.write_bytes(bytes(data))
    root = tmp_path / "cache" / tiny_paths.root.name
    why = install_shipped(root, "tiny", recipe.hash, shipped)
    assert why is not None and "sha256" in why and not root.exists()
    built = build_demo_models(
        tmp_path / "cache", "tiny", progress=False, num_threads=1, shipped_dir=shipped
    )
    assert built.built_stages == STAGES
    assert install_shipped(root, "tiny", "another", shipped) == "no shipped pair for recipe another"


def test_the_pair_shipped_in_the_package_is_the_full_recipe_and_checks():
    recipe = recipe_for("full")
    description = json.loads(
        (SHIPPED_DIR / f"{archive_name('full', recipe.hash)}.json").read_text()
    )
    archive = SHIPPED_DIR / description["archive"]
    assert description["recipe_hash"] == recipe.hash and archive.is_file()
    assert description["bytes"] == archive.stat().st_size < 12_000_000
    from osd.demo.shipped import _sha256

    assert _sha256(Path(archive)) == description["sha256"]
