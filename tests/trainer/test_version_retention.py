"""The worker keeps a bounded history of adapter versions (`adapters.keep_versions`,
`adapters.gc_grace_s`): after publishing it deletes what no rollback needs any more."""

from __future__ import annotations

from osd.adapters import open_adapter_store
from osd.adapters.lora import lora_state_dict
from osd.model_sources import attach_lora_adapters
from tests.trainer.conftest import headroom_draft, make_config, push
from trainer.wiring import wire_trainer


def test_publishing_deletes_versions_beyond_the_kept_predecessors(
    tmp_path, redis_url, stream, records
):
    config = make_config(
        tmp_path, stream, "adapters.keep_versions=1", "adapters.gc_grace_s=0", steps_per_round=60
    )
    store = open_adapter_store(tmp_path / "adapters")
    base = attach_lora_adapters(headroom_draft(), config.model, ["general@0"])
    worker = wire_trainer(config, redis_url, draft=headroom_draft(), base_model_id="toy")
    spec, weights = worker.trainer.spec("general"), lora_state_dict(base, "general@0")
    for expected in (None, 1, 2):  # earlier versions, e.g. from a previous run
        store.publish("general", weights, spec=spec, expected_current=expected)
    worker.publisher.restore("general")
    push(redis_url, stream, records)
    worker.ingest()
    report = worker.train_round("general")
    worker.close()
    assert (report.outcome, report.version) == ("published", 4), report.describe()
    assert store.list_versions("general") == [3, 4]
    assert worker.publisher.num_deleted == 2
