"""``osd up``: the embedded stack without traffic, serving until stopped."""

from __future__ import annotations

import argparse
import threading
from collections.abc import Sequence

from launcher.stack import LocalStack, install_signal_handlers
from osd.config import load_config


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="osd up", description=__doc__)
    parser.add_argument(
        "--config", default="demo", help="a YAML file, or demo: the built-in local default"
    )
    parser.add_argument("--no-trainer", action="store_true", help="serve only")
    parser.add_argument("overrides", nargs="*", help="config overrides like serve.port=9000")
    args = parser.parse_args(list(argv))
    config = load_config(args.config, args.overrides)
    config.serve.check_access()  # before anything starts
    install_signal_handlers()
    stack = LocalStack(config, with_trainer=not args.no_trainer)
    try:
        stack.start()
        trainer_pid = stack.trainer.pid if stack.trainer is not None else None
        redis_pid = f" (pid {stack.redis.pid})" if stack.redis is not None else ""
        print(
            f"osd is up: {stack.base_url}/v1 (model {config.serve.model_name!r})\n"
            f"  redis: {stack.redis_url.split('@')[-1]}{redis_pid}   trainer pid: {trainer_pid}\n"
            f"  ray session: {stack.ray_session_dir}\n"
            f"  run dir: {stack.run_dir}\n"
            f"  loop health: {stack.base_url}/ready (a redis-server or trainer that dies is "
            "restarted)\nCtrl-C stops everything.",
            flush=True,
        )
        threading.Event().wait()
    except KeyboardInterrupt:
        print("\nstopping...", flush=True)
    finally:
        stack.close()
        print("stopped.", flush=True)
    return 0
