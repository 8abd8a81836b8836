"""The ``osd`` command line: one entry point, a subcommand per job.

Before a subcommand runs, OpenMP's wait policy is made PASSIVE (unless the user chose one) for
this process and its children: see :mod:`osd.threads`. That is why each subcommand's module is
named here and imported only when it runs: importing it earlier would load torch, and OpenMP
with it, under the default policy.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from osd.config import ConfigError

# subcommand -> (module with a ``main(argv) -> int``, one-line help)
SUBCOMMANDS = {
    "demo-models": ("osd.demo.cli", "build, check or describe the offline demo model pair"),
    "serve": ("serving.cli", "run the Ray Serve app against a given Redis and Ray cluster"),
    "up": ("launcher.up", "the embedded stack (redis, Ray, Serve app, trainer) until stopped"),
    "demo": ("launcher.demo_job", "the main job: the whole online loop on shifting traffic"),
    "train": ("trainer.cli", "run the online distillation worker: records in, adapters out"),
}


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatches ``osd <subcommand> ...`` to the module that implements it."""
    parser = argparse.ArgumentParser(prog="osd", description="Online speculative decoding.")
    parser.add_argument("command", choices=sorted(SUBCOMMANDS), help="what to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the subcommand")
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    module_name, _ = SUBCOMMANDS[args.command]
    try:
        return int(importlib.import_module(module_name).main(args.args) or 0)
    except ConfigError as e:  # a config that cannot be used: one line, no traceback
        print(f"osd {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
