"""``osd demo-models``: build, locate and measure the offline demo pair; write demo workloads.

osd demo-models build [--cache-dir DIR] [--force] [--scale tiny|full]
osd demo-models path [--cache-dir DIR] [--scale tiny|full]
osd demo-models report [--cache-dir DIR] [--scale tiny|full] [--refresh] [--json]
osd demo-models workload --out FILE [--schedule prose:200,code:200,sql:200,mixed:200]
                         [--chat-share 0.2]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from osd.demo.build import STAGES, build_demo_models, demo_models_root, stage_is_complete
from osd.demo.recipe import TEXT_DOMAINS, recipe_for
from osd.demo.shipped import SHIPPED_DIR, pack

__all__ = ["main"]

DEFAULT_SCHEDULE = "prose:200,code:200,sql:200,mixed:200"


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="parent of the recipe's directory (default: $OSD_CACHE_DIR/demo-models, "
        "else ~/.cache/osd/demo-models)",
    )
    parser.add_argument("--scale", choices=["tiny", "full"], default="full", help="which recipe")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="osd demo-models", description="The offline demo model pair and its workloads."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="build the pair (skipped when cached, resumes)")
    _common(build)
    build.add_argument("--force", action="store_true", help="rebuild every stage")
    build.add_argument("--quiet", action="store_true", help="no progress output")
    build.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: every core this process may use; OSD_TORCH_THREADS)",
    )
    pack = sub.add_parser(
        "pack", help="write the built pair as the shipped archive (float16 weights, sha256)"
    )
    _common(pack)
    pack.add_argument(
        "--out", default=None, help="directory (default: the package's osd/demo/shipped)"
    )
    path = sub.add_parser("path", help="print the directory (exit 1 if not fully built)")
    _common(path)
    report = sub.add_parser("report", help="print measured numbers of the built pair")
    _common(report)
    report.add_argument("--refresh", action="store_true", help="measure again")
    report.add_argument("--json", action="store_true", help="print the report as JSON")
    report.add_argument("--prompts", type=int, default=20, help="prompts per domain")
    report.add_argument("--max-tokens", type=int, default=48, help="tokens per prompt")
    workload = sub.add_parser("workload", help="write a demo workload (JSONL) of held-out prompts")
    _common(workload)
    workload.add_argument("--out", required=True, help="output JSONL file")
    workload.add_argument(
        "--schedule",
        default=DEFAULT_SCHEDULE,
        help=f"phases 'name:count,...' in order; names: {', '.join(TEXT_DOMAINS)}, mixed, "
        f"chat (default {DEFAULT_SCHEDULE})",
    )
    workload.add_argument(
        "--chat-share",
        type=float,
        default=0.2,
        help="share of each domain's requests (code, sql, math, json) written as a chat on it "
        "(a 'messages' line, sent through /v1/chat/completions; 0: none)",
    )
    workload.add_argument("--max-tokens", type=int, default=64, help="tokens per request")
    workload.add_argument("--seed", type=int, default=0, help="seed of the order and mix")
    return parser


def _build(args: argparse.Namespace) -> int:
    paths = build_demo_models(
        args.cache_dir,
        args.scale,
        progress=not args.quiet,
        force=args.force,
        num_threads=args.threads,
    )
    print(paths.root)
    return 0


def _not_built(args: argparse.Namespace) -> bool:
    """Whether a stage of the pair is missing (then says which, and how to build it)."""
    root = demo_models_root(args.cache_dir, args.scale)
    recipe = recipe_for(args.scale)
    missing = [s for s in STAGES if not stage_is_complete(root, s, recipe)]
    if missing:
        print(
            f"{root} is not built yet (missing: {', '.join(missing)}); run: osd demo-models"
            f" build --scale {args.scale}",
            file=sys.stderr,
        )
    return bool(missing)


def _pack(args: argparse.Namespace) -> int:
    if _not_built(args):
        return 1
    recipe = recipe_for(args.scale)
    root = demo_models_root(args.cache_dir, args.scale)
    archive = pack(root, recipe.scale, recipe.hash, Path(args.out) if args.out else SHIPPED_DIR)
    print(f"{archive} ({archive.stat().st_size / 1e6:.1f} MB)")
    return 0


def _path(args: argparse.Namespace) -> int:
    print(demo_models_root(args.cache_dir, args.scale))
    return 1 if _not_built(args) else 0


def _report(args: argparse.Namespace) -> int:
    from osd.demo.build import DemoModelPaths
    from osd.demo.report import REPORT_FILE, format_report, measure_report, save_report

    recipe = recipe_for(args.scale)
    root = demo_models_root(args.cache_dir, args.scale)
    if not all(stage_is_complete(root, s, recipe) for s in STAGES):
        print(
            f"{root} is not built; run: osd demo-models build --scale {args.scale}", file=sys.stderr
        )
        return 1
    path = root / REPORT_FILE
    if args.refresh or not path.is_file():
        print("measuring (a minute or two at full scale) ...", file=sys.stderr)
        paths = DemoModelPaths(root, recipe.hash, recipe.scale)
        report = measure_report(
            paths,
            num_prompts=args.prompts,
            max_tokens=args.max_tokens,
            log=lambda line: print(line, file=sys.stderr),
        )
        save_report(report, root)
    else:
        report = json.loads(path.read_text())
    print(json.dumps(report, indent=2, ensure_ascii=False) if args.json else format_report(report))
    return 0


def _workload(args: argparse.Namespace) -> int:
    from osd.demo.corpus import heldout_dialogues, heldout_prompts
    from osd.demo.workload import make_workload, parse_schedule, write_workload

    try:
        schedule = parse_schedule(args.schedule)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    paths = build_demo_models(args.cache_dir, args.scale, stop_after_stage="corpus")
    prompts = heldout_prompts(paths.corpus, TEXT_DOMAINS)
    try:
        items = make_workload(
            prompts,
            schedule,
            max_tokens=args.max_tokens,
            seed=args.seed,
            dialogues=heldout_dialogues(paths.corpus),
            chat_share=args.chat_share,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    count = write_workload(items, args.out)
    print(f"wrote {count} requests to {args.out}", file=sys.stderr)
    return 0


def main(argv: Sequence[str]) -> int:
    """Runs ``osd demo-models <command> ...``; returns the exit status."""
    args = _parser().parse_args(list(argv))
    command = {
        "build": _build,
        "pack": _pack,
        "path": _path,
        "report": _report,
        "workload": _workload,
    }
    return command[args.command](args)
