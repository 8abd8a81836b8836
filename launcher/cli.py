"""The ``osd`` command line: one entry point, a subcommand per job.

Before a subcommand runs, OpenMP's wait policy is made PASSIVE (unless the user chose one) for
this process and its children: see :mod:`osd.threads`. That is why each subcommand imports its
module only when it runs: importing it earlier would load torch, and OpenMP
with it, under the default policy.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from osd.config import ConfigError

# Each subcommand imports its module when it runs (see the module docstring), by a plain import
# statement, so readers and type checkers see what it runs.


def _demo_models(argv: list[str]) -> int | None:
    from osd.demo.cli import main as run

    return run(argv)


def _serve(argv: list[str]) -> int | None:
    from serving.cli import main as run

    return run(argv)


def _up(argv: list[str]) -> int | None:
    from launcher.up import main as run

    return run(argv)


def _demo(argv: list[str]) -> int | None:
    from launcher.demo_job import main as run

    return run(argv)


def _train(argv: list[str]) -> int | None:
    from trainer.cli import main as run

    return run(argv)


# subcommand -> (what runs it, one-line help)
SUBCOMMANDS: dict[str, tuple[Callable[[list[str]], int | None], str]] = {
    "demo-models": (_demo_models, "build, check or describe the offline demo model pair"),
    "serve": (_serve, "run the Ray Serve app against a given Redis and Ray cluster"),
    "up": (_up, "the embedded stack (redis, Ray, Serve app, trainer) until stopped"),
    "demo": (_demo, "the main job: the whole online loop on shifting traffic"),
    "train": (_train, "run the online distillation worker: records in, adapters out"),
}


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatches ``osd <subcommand> ...`` to the module that implements it."""
    commands = "\n".join(f"  {name:12} {text}" for name, (_, text) in SUBCOMMANDS.items())
    parser = argparse.ArgumentParser(
        prog="osd",
        description="Online speculative decoding.",
        epilog=f"subcommands:\n{commands}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("command", choices=sorted(SUBCOMMANDS), help="what to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the subcommand")
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    run, _ = SUBCOMMANDS[args.command]
    try:
        return int(run(args.args) or 0)
    except ConfigError as e:  # a config that cannot be used: one line, no traceback
        print(f"osd {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
