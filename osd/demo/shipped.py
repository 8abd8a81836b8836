"""The demo pair as shipped with osd: a fresh machine installs it in seconds instead of
building it for twenty minutes.

``osd demo-models pack`` writes a built pair (every stage: corpus, tokenizer, target, draft,
with their manifests) into one ``<scale>-<recipe hash>.tar.xz`` with the weights rounded to
float16 (half the bytes; the demo's figures do not move: ``docs/demo_models.md``), and a
``<scale>-<recipe hash>.json`` beside it with the archive's sha256. :func:`install_shipped`
(called by :func:`osd.demo.build.build_demo_models` when nothing of the recipe is cached yet)
checks the sha256, extracts the stages with tarfile's ``data`` filter (no links out, no
absolute paths, no devices), turns the weights back into the float32 the recipe trains in and
moves each stage into place atomically; a missing or mismatching archive installs nothing and
the build runs as before. ``osd demo-models build --force`` always rebuilds from the recipe.

The shipped stages keep the manifests of the build that made them (recipe hash, stage keys,
versions, timings), with ``shipped`` added to the model stages' ``info``: the weights are that
build's, rounded to float16.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tarfile
import tempfile
from pathlib import Path

from safetensors.torch import load_file, save_file

__all__ = ["SHIPPED_DIR", "archive_name", "install_shipped", "pack"]

SHIPPED_DIR = Path(__file__).resolve().parent / "shipped"
_STAGES = ("corpus", "tokenizer", "target", "draft")
_MODEL_STAGES = ("target", "draft")
_WEIGHTS = "model.safetensors"
_MANIFEST = "manifest.json"


def archive_name(scale: str, recipe_hash: str) -> str:
    return f"{scale}-{recipe_hash}"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _cast(path: Path, dtype: str) -> None:
    """Rewrites a safetensors file with its floating tensors in ``dtype``."""
    import torch

    target = {"float16": torch.float16, "float32": torch.float32}[dtype]
    tensors = {
        name: (t.to(target) if t.is_floating_point() else t).contiguous()
        for name, t in load_file(str(path)).items()
    }
    save_file(tensors, str(path), metadata={"format": "pt"})


def pack(root: Path, scale: str, recipe_hash: str, out_dir: Path = SHIPPED_DIR) -> Path:
    """Writes the built pair under ``root`` as a shipped archive in ``out_dir``; returns it.

    Raises:
        FileNotFoundError: a stage is missing (build the pair first).
    """
    for stage in _STAGES:
        if not (root / stage / _MANIFEST).is_file():
            raise FileNotFoundError(f"{root / stage} is not built: run osd demo-models build")
    out_dir.mkdir(parents=True, exist_ok=True)
    name = archive_name(scale, recipe_hash)
    archive = out_dir / f"{name}.tar.xz"
    with tempfile.TemporaryDirectory(dir=out_dir) as scratch:
        staged = Path(scratch)
        for stage in _STAGES:
            shutil.copytree(root / stage, staged / stage)
        for stage in _MODEL_STAGES:
            _cast(staged / stage / _WEIGHTS, "float16")
            manifest_path = staged / stage / _MANIFEST
            manifest = json.loads(manifest_path.read_text())
            manifest.setdefault("info", {})["shipped"] = "weights rounded to float16"
            manifest_path.write_text(json.dumps(manifest, indent=2))
        partial = out_dir / f"{name}.tar.xz.partial"
        with tarfile.open(partial, "w:xz", preset=9) as tar:
            for stage in _STAGES:  # sorted names and fixed metadata: the same pair, same bytes
                for path in sorted((staged / stage).rglob("*")):
                    info = tar.gettarinfo(str(path), path.relative_to(staged).as_posix())
                    info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
                    info.mode = 0o755 if path.is_dir() else 0o644
                    if path.is_file():
                        with open(path, "rb") as f:
                            tar.addfile(info, f)
                    else:
                        tar.addfile(info)
        partial.replace(archive)
    description = {
        "scale": scale,
        "recipe_hash": recipe_hash,
        "archive": archive.name,
        "sha256": _sha256(archive),
        "bytes": archive.stat().st_size,
        "weights": "float16",
    }
    (out_dir / f"{name}.json").write_text(json.dumps(description, indent=2) + "\n")
    return archive


def install_shipped(
    root: Path, scale: str, recipe_hash: str, shipped_dir: Path = SHIPPED_DIR
) -> str | None:
    """Installs the shipped pair of this recipe into ``root`` (the recipe's cache directory).

    Returns:
        None when installed; otherwise why not (no archive for this recipe, or one that fails
        its check), and nothing under ``root`` changed.
    """
    name = archive_name(scale, recipe_hash)
    description_path = shipped_dir / f"{name}.json"
    if not description_path.is_file():
        return f"no shipped pair for recipe {recipe_hash}"
    try:
        description = json.loads(description_path.read_text())
        archive = shipped_dir / str(description["archive"])
        if description.get("recipe_hash") != recipe_hash or not archive.is_file():
            return f"the shipped pair {description_path.name} does not match this recipe"
        if _sha256(archive) != description["sha256"]:
            return f"{archive.name} fails its sha256 check"
    except (OSError, ValueError, KeyError) as exc:
        return f"the shipped pair is unreadable ({exc})"
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as scratch:
        staged = Path(scratch)
        with tarfile.open(archive, "r:xz") as tar:
            tar.extractall(staged, filter="data")
        for stage in _STAGES:
            if not (staged / stage / _MANIFEST).is_file():
                return f"{archive.name} lacks the {stage} stage"
        for stage in _MODEL_STAGES:
            _cast(staged / stage / _WEIGHTS, "float32")
            _record_sizes(staged / stage)
        for stage in _STAGES:  # inputs first: a stage appears only after those it reads
            shutil.rmtree(root / stage, ignore_errors=True)
            (staged / stage).replace(root / stage)
    return None


def _record_sizes(stage_dir: Path) -> None:
    """The manifest's file sizes as they are now (the weights were rewritten)."""
    manifest_path = stage_dir / _MANIFEST
    manifest = json.loads(manifest_path.read_text())
    manifest["files"] = {
        path.relative_to(stage_dir).as_posix(): path.stat().st_size
        for path in sorted(stage_dir.rglob("*"))
        if path.is_file() and path.name != _MANIFEST
    }
    manifest_path.write_text(json.dumps(manifest, indent=2))
