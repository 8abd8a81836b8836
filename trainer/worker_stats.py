"""What the worker reports: one `RoundReport` per training round, running `WorkerStats` totals.

Both turn into a progress line (`describe`) and a flat dict of numbers for W&B (`metrics`).
Pure: the standard library only (plus the judge's `Verdict`).
"""

from __future__ import annotations

import statistics
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from trainer.draft_trainer import StepStats
from trainer.judge import Verdict

__all__ = ["RoundReport", "WorkerStats", "latency_summary"]


@dataclass
class RoundReport:
    """One round of one adapter: its steps, the judge's verdict and what came of it.

    Attributes:
        adapter: logical adapter name.
        steps: optimizer steps run.
        fresh_records: records trained on for the first time.
        loss_sum: sum of the steps' losses.
        num_tokens: input tokens the steps ran through the draft.
        num_positions: positions the losses counted.
        train_s: seconds spent in the steps.
        verdict: the judge's verdict; None while there were too few held-out records.
        outcome: "published", "refused", "conflict", "unavailable" (the adapter store could not
            be reached), "waiting" (too few held-out records) or "yielded" (ended unjudged for
            another adapter's first version).
        version: the version published, if any.
        record_to_version_s: for each record first included by this published version, seconds
            from its arrival in the log to the publication.
    """

    adapter: str
    steps: int = 0
    fresh_records: int = 0
    loss_sum: float = 0.0
    num_tokens: int = 0
    num_positions: int = 0
    train_s: float = 0.0
    verdict: Verdict | None = None
    outcome: str = ""
    version: int | None = None
    record_to_version_s: list[float] = field(default_factory=list)

    def add_step(self, step: StepStats, num_fresh: int) -> None:
        self.steps += 1
        self.fresh_records += num_fresh
        self.loss_sum += step.loss
        self.num_tokens += step.num_tokens
        self.num_positions += step.num_positions

    @property
    def mean_loss(self) -> float:
        return self.loss_sum / self.steps if self.steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.train_s if self.train_s > 0 else 0.0

    def describe(self) -> str:
        verdict = self.verdict.describe() if self.verdict else "too few held-out records"
        version = f" v{self.version}" if self.version is not None else ""
        return (
            f"{self.adapter}: {self.steps} steps on {self.fresh_records} new records, "
            f"loss {self.mean_loss:.4f}, {self.tokens_per_s:.0f} tok/s; {verdict}; "
            f"{self.outcome}{version}"
        )

    def metrics(self) -> dict[str, float]:
        a = self.adapter
        out = {
            f"loss/{a}": self.mean_loss,
            f"throughput/{a}/tokens_per_s": self.tokens_per_s,
            f"records/{a}/fresh_per_round": float(self.fresh_records),
        }
        if self.verdict is not None:
            out[f"acceptance/{a}/candidate"] = self.verdict.candidate.lower
            out[f"acceptance/{a}/current"] = self.verdict.current.lower
            out[f"acceptance/{a}/candidate_upper"] = self.verdict.candidate.upper
            out[f"acceptance/{a}/gain"] = self.verdict.gain
        if self.version is not None:
            out[f"version/{a}"] = float(self.version)
        if self.record_to_version_s:
            out[f"latency/{a}/record_to_version_s"] = statistics.fmean(self.record_to_version_s)
        return out


@dataclass
class WorkerStats:
    """Running totals of one worker process.

    Attributes:
        read: records read as new entries.
        claimed: records claimed from pending entries (a restart's own, or dead consumers').
        held_out: records put in the judge's windows.
        skipped: records that cannot train this draft (no prompt or tokens, ids out of vocab).
        rounds, steps: training rounds and optimizer steps.
        trained_records: (record, adapter) pairs trained on for the first time.
        num_tokens: input tokens through the draft in training steps; train_s: their seconds.
        published, refused, conflicts: the judge's and the store's outcomes.
        store_errors: publishes that failed because the adapter store could not be reached.
        by_domain: training records per domain ("-" for none).
        latencies: record-to-version seconds of the most recent published records.
    """

    read: int = 0
    claimed: int = 0
    held_out: int = 0
    skipped: int = 0
    rounds: int = 0
    steps: int = 0
    trained_records: int = 0
    num_tokens: int = 0
    train_s: float = 0.0
    published: int = 0
    refused: int = 0
    conflicts: int = 0
    store_errors: int = 0
    by_domain: Counter[str] = field(default_factory=Counter)
    latencies: deque[float] = field(default_factory=lambda: deque(maxlen=10_000))

    def add_round(self, report: RoundReport) -> None:
        self.rounds += 1
        self.steps += report.steps
        self.trained_records += report.fresh_records
        self.num_tokens += report.num_tokens
        self.train_s += report.train_s

    def describe(self) -> str:
        return (
            f"records read {self.read} claimed {self.claimed} held out {self.held_out} "
            f"trained {self.trained_records}; published {self.published} refused "
            f"{self.refused} conflicts {self.conflicts} store errors {self.store_errors}"
        )

    def metrics(self) -> dict[str, float]:
        out = {
            "records/read": float(self.read),
            "records/claimed": float(self.claimed),
            "records/held_out": float(self.held_out),
            "records/skipped": float(self.skipped),
            "records/trained": float(self.trained_records),
            "publishes": float(self.published),
            "refusals": float(self.refused),
            "conflicts": float(self.conflicts),
            "store_errors": float(self.store_errors),
            "throughput/tokens_per_s": self.num_tokens / self.train_s if self.train_s else 0.0,
        }
        out.update({f"records/domain/{d}": float(n) for d, n in self.by_domain.items()})
        return out

    def as_dict(self) -> dict[str, Any]:
        """Plain totals (JSON-ready), with latency percentiles."""
        out: dict[str, Any] = {
            k: getattr(self, k)
            for k in (
                "read", "claimed", "held_out", "skipped", "rounds", "steps", "trained_records",
                "num_tokens", "train_s", "published", "refused", "conflicts", "store_errors",
            )
        }  # fmt: skip
        out["by_domain"] = dict(self.by_domain)
        if self.latencies:
            out["record_to_version_s"] = latency_summary(self.latencies)
        return out


def latency_summary(latencies: Iterable[float]) -> dict[str, float]:
    """p50, p90, max and mean of record-to-version seconds (at least one)."""
    ordered = sorted(latencies)
    return {
        "p50": ordered[len(ordered) // 2],
        "p90": ordered[int(len(ordered) * 0.9)],
        "max": ordered[-1],
        "mean": statistics.fmean(ordered),
    }
