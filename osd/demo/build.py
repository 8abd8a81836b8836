"""Builds the demo model pair into a cache directory, stage by stage, resumably.

Stages, in order: ``corpus`` -> ``tokenizer`` -> ``target`` and ``draft``. Each stage is written
into ``<stage>.partial/`` and renamed to ``<stage>/`` with a ``manifest.json`` once complete, so
an interrupted stage never looks done. A stage is skipped when its manifest matches the recipe
hash, the stage's own settings and the output hashes of the stages it reads; a second build of
the same recipe therefore does no work, and a rebuilt stage that comes out identical (the build
is seeded) leaves the later ones valid. The two training stages also save a checkpoint every
``checkpoint_every`` steps (see :mod:`osd.demo.training`) and resume from it after an
interruption; the cheap stages simply restart. A file lock serialises concurrent builds.

Layout of ``<cache>/<scale>-<recipe hash>/``: ``recipe.json``, ``corpus/<domain>/{train,
heldout}.jsonl``, ``tokenizer/``, ``target/`` and ``draft/`` (Hugging Face format, safetensors,
tokenizer included), ``checkpoints/`` while training.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import json
import os
import platform
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from osd.cache_dir import osd_cache_dir
from osd.demo.corpus import build_corpus, load_corpus_split, save_corpus
from osd.demo.progress import Progress
from osd.demo.recipe import DOMAINS, Recipe, recipe_for
from osd.demo.shipped import SHIPPED_DIR, install_shipped
from osd.demo.training import encode_streams, new_model, train_model
from osd.demo.vocab import train_tokenizer
from osd.threads import threads_applied

__all__ = [
    "STAGES",
    "DemoModelPaths",
    "build_demo_models",
    "default_cache_dir",
    "demo_models_root",
    "read_manifest",
    "stage_is_complete",
]

STAGES = ("corpus", "tokenizer", "target", "draft")
_INPUTS = {"corpus": (), "tokenizer": ("corpus",), "target": STAGES[:2], "draft": STAGES[:2]}
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class DemoModelPaths:
    """Where a built demo pair lives.

    Attributes:
        root: the recipe's cache directory.
        recipe_hash: hash of the recipe that built it.
        scale: ``"full"`` or ``"tiny"``.
        built_stages: stages this call (re)built; empty when everything was cached.
    """

    root: Path
    recipe_hash: str
    scale: str
    built_stages: tuple[str, ...] = ()

    @property
    def corpus(self) -> Path:
        return self.root / "corpus"

    @property
    def tokenizer(self) -> Path:
        return self.root / "tokenizer"

    @property
    def target(self) -> Path:
        return self.root / "target"

    @property
    def draft(self) -> Path:
        return self.root / "draft"


def default_cache_dir() -> Path:
    """``$OSD_CACHE_DIR/demo-models`` if set, else ``~/.cache/osd/demo-models``."""
    return osd_cache_dir() / "demo-models"


def demo_models_root(cache_dir: Path | str | None = None, scale: str = "full") -> Path:
    """The directory a recipe builds into: ``<cache_dir>/<scale>-<recipe hash>``."""
    recipe = recipe_for(scale)
    base = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return base.expanduser() / f"{recipe.scale}-{recipe.hash}"


def read_manifest(root: Path, stage: str) -> dict[str, Any] | None:
    """A stage's manifest, or None when it is missing or unreadable."""
    try:
        manifest = json.loads((root / stage / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def _stage_key(recipe: Recipe, stage: str, root: Path) -> str | None:
    """Hash of a stage's settings and its inputs' output hashes; None if an input is missing."""
    inputs = {}
    for name in _INPUTS[stage]:
        manifest = read_manifest(root, name)
        if manifest is None:
            return None
        inputs[name] = manifest["output_hash"]
    text = json.dumps({"stage": recipe.stage_dict(stage), "inputs": inputs}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _files_hash(directory: Path) -> tuple[str, dict[str, int]]:
    """sha256 over the stage's files (names and contents, sorted) and their sizes."""
    digest = hashlib.sha256()
    sizes = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST):
        name = path.relative_to(directory).as_posix()
        digest.update(name.encode() + b"\0")
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        sizes[name] = path.stat().st_size
    return digest.hexdigest(), sizes


def stage_is_complete(root: Path, stage: str, recipe: Recipe) -> bool:
    """True when the stage's manifest matches the recipe, its inputs and the files on disk."""
    manifest = read_manifest(root, stage)
    if manifest is None or manifest.get("recipe_hash") != recipe.hash:
        return False
    if manifest.get("stage_key") != _stage_key(recipe, stage, root):
        return False
    for name, size in manifest.get("files", {}).items():
        path = root / stage / name
        if not path.is_file() or path.stat().st_size != size:
            return False
    return True


@dataclass
class _Context:
    recipe: Recipe
    root: Path
    progress: Progress
    on_train_step: Callable[[str, int], None] | None
    tune_threads: bool = False  # the thread count was chosen automatically: tune it


def _corpus_stage(ctx: _Context, out: Path) -> dict[str, Any]:
    corpus = build_corpus(ctx.recipe.corpus)
    save_corpus(corpus, out)
    return {
        domain: {split: len(docs) for split, docs in splits.items()}
        | {"train_chars": sum(len(d.text) for d in splits["train"])}
        for domain, splits in corpus.items()
    }


def _train_texts(ctx: _Context, domains: Any) -> dict[str, list[str]]:
    return {
        d: [doc.text for doc in load_corpus_split(ctx.root / "corpus", d, "train")] for d in domains
    }


def _tokenizer_stage(ctx: _Context, out: Path) -> dict[str, Any]:
    texts = _train_texts(ctx, DOMAINS)
    tokenizer = train_tokenizer((t for d in DOMAINS for t in texts[d]), ctx.recipe.tokenizer)
    tokenizer.save_pretrained(out)
    return {"vocab_size": len(tokenizer)}


def _model_stage(ctx: _Context, out: Path, role: str) -> dict[str, Any]:
    from transformers import AutoTokenizer

    model_recipe = getattr(ctx.recipe, role)
    train_recipe = getattr(ctx.recipe, f"{role}_train")
    tokenizer = AutoTokenizer.from_pretrained(ctx.root / "tokenizer")
    streams = encode_streams(tokenizer, _train_texts(ctx, sorted(train_recipe.domains)))
    special = {
        "bos": tokenizer.bos_token_id,
        "eos": tokenizer.eos_token_id,
        "pad": tokenizer.pad_token_id,
    }
    model = new_model(model_recipe, len(tokenizer), special, seed=train_recipe.seed)
    key = _stage_key(ctx.recipe, role, ctx.root)
    assert key is not None  # the inputs were built first
    hook = ctx.on_train_step
    result = train_model(
        model,
        streams,
        train_recipe,
        checkpoint_dir=ctx.root / "checkpoints" / role,
        key=key,
        progress=ctx.progress,
        name=role,
        on_step=(lambda step: hook(role, step)) if hook else None,
        tune_threads=ctx.tune_threads,
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "train_log.json").write_text(json.dumps({"losses": result.losses}))
    tail = result.losses[-10:]
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_tokens": {d: int(s.numel()) for d, s in streams.items()},
        "final_loss": sum(tail) / len(tail),
        "resumed_from_step": result.resumed_from,
    }


_BUILDERS: dict[str, Callable[[_Context, Path], dict[str, Any]]] = {
    "corpus": _corpus_stage,
    "tokenizer": _tokenizer_stage,
    "target": lambda ctx, out: _model_stage(ctx, out, "target"),
    "draft": lambda ctx, out: _model_stage(ctx, out, "draft"),
}


def _run_stage(ctx: _Context, stage: str) -> None:
    """Builds one stage into ``<stage>.partial`` and moves it into place with its manifest."""
    final, partial = ctx.root / stage, ctx.root / f"{stage}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    ctx.progress.message(f"[osd demo-models] building stage {stage!r} in {ctx.root}")
    started, cpu_started = time.perf_counter(), time.process_time()
    info = _BUILDERS[stage](ctx, partial)
    output_hash, sizes = _files_hash(partial)
    manifest = {
        "stage": stage,
        "recipe_hash": ctx.recipe.hash,
        "stage_key": _stage_key(ctx.recipe, stage, ctx.root),
        "output_hash": output_hash,
        "files": sizes,
        "seconds": round(time.perf_counter() - started, 2),
        "cpu_seconds": round(time.process_time() - cpu_started, 2),
        "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "versions": _versions(),
        "info": info,
    }
    (partial / MANIFEST).write_text(json.dumps(manifest, indent=2))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(partial, final)
    shutil.rmtree(ctx.root / "checkpoints" / stage, ignore_errors=True)
    ctx.progress.message(f"[osd demo-models] stage {stage!r} done in {manifest['seconds']:.1f}s")


def _versions() -> dict[str, str]:
    import tokenizers
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "machine": platform.machine(),
    }


@contextlib.contextmanager
def _locked(root: Path, progress: Progress) -> Iterator[None]:
    """Holds an exclusive lock on the cache directory (other builders wait)."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress.message(f"[osd demo-models] waiting for another build of {root}")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def build_demo_models(
    cache_dir: Path | str | None = None,
    scale: str = "full",
    *,
    progress: bool = True,
    force: bool = False,
    stop_after_stage: str | None = None,
    num_threads: int | None = None,
    on_train_step: Callable[[str, int], None] | None = None,
    shipped_dir: Path | str | None = None,
) -> DemoModelPaths:
    """Builds (or finds in the cache) the demo target/draft pair, tokenizer and corpus.

    Args:
        cache_dir: parent of the recipe's directory (default :func:`default_cache_dir`).
        scale: ``"full"`` (the demo pair, minutes) or ``"tiny"`` (tests, seconds).
        progress: report stages and training progress on stderr.
        force: rebuild every stage even if cached.
        stop_after_stage: return after this stage (e.g. ``"corpus"`` for the workloads only).
        num_threads: torch threads while building (restored after); None: chosen from the
            cores this process may use (:mod:`osd.threads`; ``OSD_TORCH_THREADS`` overrides).
            Chosen, it may drop to 1 while that is measurably faster (a busy neighbour:
            :class:`osd.threads.ThreadTuner`). The weights depend slightly on the count: pin it
            to reproduce them elsewhere.
        on_train_step: called as ``(stage, finished_steps)`` after each training step; tests
            raise from it to simulate an interruption.
        shipped_dir: where shipped pairs are (default: the package's,
            :mod:`osd.demo.shipped`); when nothing of the recipe is cached and a shipped pair
            of it passes its sha256 check, it is installed instead of built (``force``: never).

    Returns:
        The paths, with ``built_stages`` naming the stages this call built.
    """
    recipe = recipe_for(scale)
    if stop_after_stage is not None and stop_after_stage not in STAGES:
        raise ValueError(f"stop_after_stage must be one of {STAGES}, got {stop_after_stage!r}")
    root = demo_models_root(cache_dir, scale)
    reporter = Progress(progress)
    ctx = _Context(recipe, root, reporter, on_train_step)
    wanted = STAGES[: STAGES.index(stop_after_stage) + 1] if stop_after_stage else STAGES
    built: list[str] = []
    if not force and all(stage_is_complete(root, s, recipe) for s in wanted):
        # Stages appear atomically (renamed into place), so no lock is needed to find them.
        reporter.message(f"[osd demo-models] cached: {root}")
        return DemoModelPaths(root, recipe.hash, recipe.scale, ())
    with (
        _locked(root, reporter),
        threads_applied("build", num_threads or 0) as threads,
    ):
        reporter.message(f"[osd demo-models] {threads.describe()}")
        ctx.tune_threads = threads.source == "auto" and threads.num_threads > 1
        (root / "recipe.json").write_text(
            json.dumps({"hash": recipe.hash, "recipe": recipe.to_dict()}, indent=2)
        )
        if not force and not any(stage_is_complete(root, s, recipe) for s in STAGES):
            started = time.perf_counter()
            shipped = SHIPPED_DIR if shipped_dir is None else Path(shipped_dir)
            why_not = install_shipped(root, recipe.scale, recipe.hash, shipped)
            if why_not is None and all(stage_is_complete(root, s, recipe) for s in wanted):
                reporter.message(
                    f"[osd demo-models] installed the shipped pair (float16 weights, sha256 "
                    f"checked) in {time.perf_counter() - started:.1f}s: {root}"
                )
                return DemoModelPaths(root, recipe.hash, recipe.scale, ())
            reporter.message(f"[osd demo-models] building: {why_not or 'shipped pair incomplete'}")
        for stage in wanted:
            if not force and stage_is_complete(root, stage, recipe):
                continue
            _run_stage(ctx, stage)
            built.append(stage)
    if not built:
        reporter.message(f"[osd demo-models] cached: {root}")
    return DemoModelPaths(root, recipe.hash, recipe.scale, tuple(built))
