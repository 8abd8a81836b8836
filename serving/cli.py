"""``osd serve``: run the Serve app against a given Redis and Ray cluster (or local ones)."""

from __future__ import annotations

import argparse
import dataclasses
import signal
import threading
from collections.abc import Sequence

from osd.config import ServeConfig, load_config


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="osd serve", description=__doc__)
    parser.add_argument("--config", help="YAML config (default: built-in defaults)")
    parser.add_argument(
        "--redis-url",
        default="",
        help="log buffer and adapter store "
        "(default: log.redis_url from the config; empty: no logging)",
    )
    parser.add_argument(
        "--ray-address", default=None, help="existing Ray cluster (default: start a local one)"
    )
    parser.add_argument("overrides", nargs="*", help="config overrides like serve.port=9000")
    args = parser.parse_args(list(argv))
    config = load_config(args.config, args.overrides)
    config.serve.check_access()  # before anything starts

    import ray
    from ray import serve

    from serving.app import build_app
    from serving.ingress import Ingress

    # Ray's processes read the ingress settings when they start: where this command starts
    # Ray; a cluster given by --ray-address keeps the ones it was started with.
    ingress = Ingress(config.serve if args.ray_address is None else _proxy(config.serve))
    ray.init(
        address=args.ray_address,
        include_dashboard=False,
        ignore_reinit_error=True,
        runtime_env={"env_vars": ingress.apply()},
    )
    serve.start(http_options={"host": config.serve.host, "port": config.serve.port})
    serve.run(
        build_app(config, args.redis_url or config.log.redis_url), name="osd", route_prefix="/"
    )
    print(
        f"osd serving {config.serve.model_name!r} at "
        f"http://{config.serve.host}:{config.serve.port}/v1  (Ctrl-C stops)",
        flush=True,
    )
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    try:
        stopped.wait()
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
        ingress.close()
    return 0


def _proxy(serve: ServeConfig) -> ServeConfig:
    if serve.ingress != "proxy":
        print(
            "osd serve --ray-address: the cluster's own Ray Serve settings decide the ingress "
            "(serve.ingress applies where osd starts Ray; see serving/ingress.py)",
            flush=True,
        )
    return dataclasses.replace(serve, ingress="proxy")
