"""The worker against a real redis-server: it learns from logged records, publishes only what the
judge accepts, publishes with compare-and-set, and its versions load into a replica's draft."""

from __future__ import annotations

import dataclasses
import uuid

import pytest
import torch

from osd.adapters import open_adapter_store
from osd.adapters.lora import base_model_hash, install_adapter, lora_shapes, lora_state_dict
from osd.buffer.redis_server import connect
from osd.model_sources import attach_lora_adapters
from osd.versions.errors import BASE_VERSION
from tests.trainer.conftest import headroom_draft, make_config, model_acceptance, push
from tests.trainer.routing_fakes import FakeScorer, topic_examples
from trainer.schedule import expected_gain
from trainer.wiring import wire_trainer
from trainer.worker import TrainerWorker


def run_until_idle(worker: TrainerWorker, max_calls: int = 200) -> list:
    reports = []
    for _ in range(max_calls):
        report = worker.run_once(block_ms=50)
        if report is not None:
            reports.append(report)
        elif not any(d.fresh for d in worker.data.values()) and worker.ingest(block_ms=50) == 0:
            break
    return reports


def new_worker(config, redis_url, **kwargs) -> TrainerWorker:
    return wire_trainer(config, redis_url, draft=headroom_draft(), base_model_id="toy", **kwargs)


def pending_count(redis_url: str, stream: str, group: str) -> int:
    client = connect(redis_url)
    try:
        return int(client.xpending(stream, group)["pending"])
    finally:
        client.close()


def test_training_raises_held_out_acceptance_and_publishes_the_judges_number(
    tmp_path, redis_url, stream, records
):
    config = make_config(tmp_path, stream, steps_per_round=60)
    push(redis_url, stream, records)
    worker = new_worker(config, redis_url)
    reports = run_until_idle(worker)
    worker.close()

    published = [r for r in reports if r.outcome == "published"]
    assert published, [r.describe() for r in reports]
    last = published[-1]
    store = open_adapter_store(tmp_path / "adapters")
    assert store.current("general") == last.version
    manifest = store.manifest("general", last.version)
    assert manifest.acceptance_estimate == pytest.approx(last.verdict.candidate.lower, abs=1e-12)
    assert manifest.parent_version == (published[-2].version if len(published) > 1 else None)

    # Independently of the trainer: the published adapter, installed in a replica-shaped draft,
    # accepts more on the held-out records (the judge's window, never trained on) than the base
    # draft does.
    held = worker.data["general"].holdout
    holdout = [e.record for e in held]
    assert not {e.entry_id for e in held} & {e.entry_id for e in worker.data["general"].replay}
    replica = attach_lora_adapters(headroom_draft(), config.model, ["general@0"])
    manifest, weights = store.load(
        "general",
        last.version,
        expected_base_model_hash=base_model_hash(replica),
        expected_shapes=lora_shapes(replica, "general@0"),
    )
    install_adapter(replica, f"general@{last.version}", manifest, weights)
    base = model_acceptance(headroom_draft(), holdout)
    replica.set_adapter(f"general@{last.version}")
    trained = model_acceptance(replica, holdout)
    print(f"held-out acceptance: base {base.lower:.4f} -> trained {trained.lower:.4f}")
    assert trained.lower > base.lower + 0.03, (base, trained)
    assert worker.stats.published == len(published)
    # Every record judged first, then trained once newer ones pushed it out of the judge's
    # window; only those still in it wait (pending: a restarted trainer would claim them).
    assert worker.stats.held_out == len(records)
    assert worker.stats.trained_records == len(records) - len(held)
    assert len(held) == int(len(records) * config.trainer.holdout_fraction)
    assert pending_count(redis_url, stream, config.trainer.group) == len(held)


def test_degraded_candidate_is_refused_and_not_published(tmp_path, redis_url, stream, records):
    config = make_config(tmp_path, stream)
    push(redis_url, stream, records[:96])
    worker = new_worker(config, redis_url)
    worker.ingest()
    assert len(worker.data["general"].holdout) >= config.trainer.min_holdout_records
    gen = torch.Generator().manual_seed(0)
    noisy = {
        k: v + 0.3 * torch.randn(v.shape, generator=gen)
        for k, v in worker.trainer.weights("general").items()
    }
    worker.trainer.set_weights("general", noisy, ["candidate"])

    report = worker.judge_and_publish("general")
    worker.close()

    assert report.outcome == "refused"
    assert report.verdict.candidate.lower < report.verdict.current.lower
    assert worker.stats.refused == 1 and worker.stats.published == 0
    assert open_adapter_store(tmp_path / "adapters").current("general") is None


def worker_on_the_shared_redis_store(tmp_path, redis_url, stream, records):
    """(adapter name, worker holding 96 records): an adapter of its own on the session's Redis
    store, which other tests share."""
    name = f"general-{uuid.uuid4().hex[:8]}"
    config = make_config(tmp_path, stream, "adapters.store=redis", f"model.adapters=[{name}]")
    push(redis_url, stream, records[:96])
    worker = new_worker(config, redis_url)
    worker.ingest()
    return name, worker


def test_concurrent_publish_is_a_handled_conflict_not_a_clobber(
    tmp_path, redis_url, stream, records
):
    name, worker = worker_on_the_shared_redis_store(tmp_path, redis_url, stream, records)
    store = open_adapter_store(redis_url)
    other = attach_lora_adapters(headroom_draft(), worker.config.model, [f"{name}@0"])
    rival = store.publish(
        name,
        lora_state_dict(other, f"{name}@0"),
        spec=worker.trainer.spec(name),
        expected_current=None,
        acceptance_estimate=0.5,
    )

    report = worker.train_round(name)

    assert report.outcome == "conflict", report.describe()
    assert store.current(name) == rival.version  # the rival's version stays current
    assert worker.publisher.versions[name] == rival.version
    assert worker.stats.conflicts == 1
    for slot in ("candidate", "current"):  # current: what the judge compares candidates with
        reloaded = worker.trainer.weights(name, slot)
        for key, value in lora_state_dict(other, f"{name}@0").items():
            torch.testing.assert_close(reloaded[key], value, rtol=0, atol=0)

    # Training goes on from the rival's version and publishes over it.
    report = worker.train_round(name)
    worker.close()
    assert report.outcome == "published", report.describe()
    assert store.manifest(name, report.version).parent_version == rival.version
    store.close()


def test_after_a_rollback_to_the_base_draft_training_starts_over_from_it(
    tmp_path, redis_url, stream, records
):
    name, worker = worker_on_the_shared_redis_store(tmp_path, redis_url, stream, records)
    assert worker.train_round(name).outcome == "published"
    store = open_adapter_store(redis_url)
    store.rollback(name, BASE_VERSION, expected_current=1)  # a replica's live monitor

    report = worker.train_round(name)  # its publish conflicts: it learns of the rollback

    assert report.outcome == "conflict", report.describe()
    assert worker.publisher.versions[name] == BASE_VERSION
    for slot in ("candidate", "current"):
        weights = worker.trainer.weights(name, slot)
        assert all(not v.any() for k, v in weights.items() if "lora_B" in k)  # the base draft
    push(redis_url, stream, records[96:192])
    worker.ingest()
    report = worker.train_round(name)
    worker.close()
    assert report.outcome == "published", report.describe()
    assert store.current(name) == report.version
    assert store.manifest(name, report.version).parent_version is None
    store.close()


def test_domain_records_train_general_and_their_adapter_and_are_acked_after_both(
    tmp_path, redis_url, stream, records
):
    config = make_config(tmp_path, stream, "model.adapters=[general,code]", steps_per_round=4)
    code = [dataclasses.replace(r, domain="code") for r in records[:32]]
    ids = push(redis_url, stream, code + records[32:64])
    code_ids = set(ids[:32])
    worker = new_worker(config, redis_url)
    worker.ingest()
    general, code_data = worker.data["general"], worker.data["code"]
    assert len(general.fresh) + len(general.holdout) == 64
    assert len(code_data.fresh) + len(code_data.holdout) == 32
    assert {e.entry_id for e in [*code_data.fresh, *code_data.holdout]} == code_ids

    worker.train_round("general")
    used = {e.entry_id for e in general.replay}
    assert used & code_ids and used - code_ids
    # A plain record is done once general used it; a code record waits for the code adapter.
    assert not any(entry_id in worker.acks for entry_id in used - code_ids)
    assert all(entry_id in worker.acks for entry_id in used & code_ids)
    worker.train_round("code")
    assert not code_data.fresh
    assert not any(entry_id in worker.acks for entry_id in used)
    worker.close()


def test_restarted_worker_claims_what_a_crashed_one_left_pending_and_never_acked_entries(
    tmp_path, redis_url, stream, records
):
    config = make_config(tmp_path, stream, steps_per_round=2, min_records=64)
    ids = push(redis_url, stream, records[:64])
    crashed = new_worker(config, redis_url, consumer="a")
    crashed.ingest()
    crashed.train_round("general")
    acked = {e.entry_id for e in crashed.data["general"].replay}
    pending = pending_count(redis_url, stream, config.trainer.group)
    assert pending == 64 - len(acked) > 0  # held-out records too: they are to be trained on
    # The crash: no close, nothing more acknowledged; a new process takes over.

    worker = new_worker(config, redis_url, consumer="b")
    assert worker.stats.claimed == pending
    data = worker.data["general"]
    assert {e.entry_id for e in [*data.fresh, *data.holdout]} == set(ids) - acked
    run_until_idle(worker)
    worker.close()
    assert worker.stats.trained_records == pending - len(data.holdout)
    assert pending_count(redis_url, stream, config.trainer.group) == len(data.holdout)


def test_a_new_domain_gets_a_first_version_from_16_records_starting_from_the_general_one(
    tmp_path, redis_url, stream, records
):
    config = make_config(
        tmp_path, stream, "model.adapters=[general,code]", min_records=64, steps_per_round=30
    )
    push(redis_url, stream, records[:64])
    worker = new_worker(config, redis_url)
    worker.ingest()
    assert worker.train_round("general").outcome == "published"

    # The shift: 16 records of a domain whose adapter has no version yet. A full round would
    # wait for min_records (64) fresh ones; the first version is due with 8 to train on and 8
    # to judge on, and the round goes to it, not to general, whose records the draft knows.
    code = [dataclasses.replace(r, domain="code") for r in records[64:80]]
    push(redis_url, stream, code)
    worker.ingest()
    code_data = worker.data["code"]
    assert (len(code_data.fresh), len(code_data.holdout)) == (8, 8)
    assert worker.ready() == ["code"]
    general = worker.trainer.weights("general", "current")
    assert worker.publisher.start_from_best("code", [e.record for e in code_data.holdout]) == (
        "general"
    )
    for key, value in worker.trainer.weights("code", "candidate").items():
        torch.testing.assert_close(value, general[key], rtol=0, atol=0)
    assert all(
        not v.any() for k, v in worker.trainer.weights("code", "current").items() if "lora_B" in k
    )  # the judge compares with what serves code now: the base draft

    report = worker.run_once(block_ms=0)
    worker.close()
    assert report is not None and report.adapter == "code"
    assert report.outcome == "published", report.describe()
    judged = {e.entry_id for e in code_data.holdout}
    assert judged and not judged & {e.entry_id for e in code_data.replay}


def test_a_running_round_yields_when_a_new_domain_becomes_due_its_first_version(
    tmp_path, redis_url, stream, records
):
    config = make_config(tmp_path, stream, "model.adapters=[general,code]", steps_per_round=10)
    push(redis_url, stream, records[:64])
    worker = new_worker(config, redis_url)
    worker.ingest()
    assert worker.train_round("general").outcome == "published"
    push(redis_url, stream, records[64:112])
    worker.ingest()
    code = [dataclasses.replace(r, domain="code") for r in records[112:128]]
    # The shift lands while general trains: after its first step.
    worker.on_trained = lambda adapter, _ids: push(redis_url, stream, code) if adapter else None
    report = worker.train_round("general")
    worker.on_trained = None
    assert report.outcome == "yielded" and report.steps == 1, report.describe()
    assert report.verdict is None  # not judged: its candidate is after its next round
    # General has more fresh records, which the draft gets as wrong as code's (the same traffic
    # relabelled): it has the larger expected gain, yet code's first version goes first.
    assert expected_gain(worker.data["general"].fresh) > expected_gain(worker.data["code"].fresh)
    report = worker.run_once(block_ms=0)
    worker.close()
    assert report is not None and report.adapter == "code" and report.outcome == "published"


def test_a_refused_first_round_waits_like_any_other_round_and_preempts_nothing(
    tmp_path, redis_url, stream, records
):
    config = make_config(
        tmp_path, stream, "model.adapters=[general,code]", min_records=64, publish_margin=0.9
    )
    code = [dataclasses.replace(r, domain="code") for r in records[:32]]
    push(redis_url, stream, code[:16])
    worker = new_worker(config, redis_url)
    worker.ingest()
    assert "code" in worker.ready()
    assert worker.train_round("code").outcome == "refused"  # the margin refuses everything
    push(redis_url, stream, code[16:24])
    worker.ingest()
    # 8 more records would make an adapter without a version due its first round again; this
    # one had its first round, so it waits for min_records (or max_record_wait_s) like the
    # others, and cannot make their rounds yield to it every 8 records.
    assert len(worker.data["code"].fresh) == 8 and "code" not in worker.ready(now=0.0)
    worker.close()


def test_unlabeled_records_of_a_new_topic_open_a_domain_adapter_and_are_acked_after_both(
    tmp_path, redis_url, stream
):
    config = make_config(
        tmp_path, stream, "model.adapters=[general,code,sql]", min_records=16, steps_per_round=4
    )
    prose, code = topic_examples("prose", 24), topic_examples("code", 16)
    ids = push(redis_url, stream, [e.record for e in prose + code])
    worker = new_worker(config, redis_url)
    worker.routing.score_fn = FakeScorer()  # scores by topic: the toy draft knows none
    worker.ingest()
    # The 16th poorly served code record opened a topic on the first free domain adapter, and
    # the 15 before it went there too: 8 to train on, 8 to judge on.
    code_data = worker.data["code"]
    assert {e.entry_id for e in [*code_data.fresh, *code_data.holdout]} == set(ids[24:])
    assert not worker.data["sql"].fresh and not worker.data["sql"].holdout
    assert set(worker.routing.topics.topics) == {"code"}
    assert "code" in worker.ready()  # due its first version
    run_until_idle(worker)
    worker.close()
    # Every code record that left the judge windows was trained on by both adapters, then acked.
    judging = {e.entry_id for d in worker.data.values() for e in d.holdout}
    assert set(ids) - judging
    assert pending_count(redis_url, stream, config.trainer.group) == len(judging & set(ids)), (
        "acknowledged once every adapter that holds it trained on it"
    )
