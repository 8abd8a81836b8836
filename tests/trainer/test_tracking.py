"""W&B: offline runs stay on disk in the given directory, online needs a key, disabled imports
nothing; and the CLI refuses bad configs before loading any model."""

from __future__ import annotations

import importlib
import sys

from osd.config import load_config
from trainer.cli import main
from trainer.tracking import NullTracker, open_tracker, wandb_key_configured


def test_online_without_a_key_logs_offline_into_the_run_directory(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.setenv("WANDB_MODE", "")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    assert not wandb_key_configured()
    config = load_config(None, ["wandb.mode=online", f"wandb.dir={tmp_path / 'wb'}"])

    tracker = open_tracker(config)
    tracker.log({"loss/general": 0.5, "publishes": 1.0}, step=1)
    tracker.close()

    runs = list((tmp_path / "wb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert list(runs[0].glob("*.wandb"))


def test_key_in_environment_counts_as_configured(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_key_configured()


def test_disabled_tracking_and_the_actor_wrapper_import_neither_wandb_nor_ray(monkeypatch):
    import trainer.actor

    # A module set to None in sys.modules cannot be imported: any attempt would raise.
    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.setitem(sys.modules, "ray", None)
    importlib.reload(trainer.actor)
    tracker = open_tracker(load_config(None, ["wandb.mode=disabled"]))
    tracker.log({"x": 1.0}, step=0)
    tracker.close()
    assert isinstance(tracker, NullTracker)


def test_cli_refuses_unknown_keys_and_a_missing_redis_url(capsys):
    assert main(["trainer.bogus=1"]) == 2
    assert "bogus" in capsys.readouterr().err
    assert main(["log.redis_url="]) == 2
    assert "Redis URL" in capsys.readouterr().err
