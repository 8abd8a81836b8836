"""The trainer and the replicas find the adapter store from one config the same way: what the
trainer publishes is what a replica's watcher loads. With ``adapters.store=directory`` and no
``adapters.root`` the watcher once looked elsewhere than the trainer's ``<run_dir>/adapters``."""

from __future__ import annotations

import uuid

import pytest

from osd.adapters import adapter_store_location, open_adapter_store
from osd.config import load_config
from serving.replica import wire_replica
from trainer.wiring import wire_trainer


@pytest.mark.parametrize("root", ["", "shared-adapters"])
def test_a_version_the_trainer_publishes_is_loaded_by_a_replica_of_the_same_config(
    tmp_path, monkeypatch, redis_url, stream, root
):
    monkeypatch.chdir(tmp_path)  # a relative root resolves here, for trainer and replica alike
    config = load_config(
        None,
        [
            "model.target=toy:target",
            "model.draft=toy:draft",
            "model.adapters=[general]",
            "adapters.store=directory",
            f"adapters.root={root}",
            f"run_dir={tmp_path / 'run'}",
            f"log.stream={stream}",
            f"trainer.group=g-{uuid.uuid4().hex[:8]}",
            "trainer.device=cpu",
            "wandb.mode=disabled",
        ],
    )
    worker = wire_trainer(config, redis_url)  # its store from the config, as in production
    try:
        manifest = worker.publisher.publish("general", acceptance_estimate=0.5)
    finally:
        worker.close()
    assert manifest is not None
    where = tmp_path / (root or "run/adapters")
    assert open_adapter_store(where).current("general") == manifest.version

    # The replica opens the store as serving.app.OSDReplica does.
    replica = wire_replica(
        config, store=open_adapter_store(adapter_store_location(config, redis_url))
    )
    try:
        assert replica.runtime.slots.current("general") == manifest.version
        assert replica.watcher is not None and replica.watcher.refused() == set()
    finally:
        replica.close()
