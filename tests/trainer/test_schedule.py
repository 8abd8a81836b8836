"""Which adapter trains next: the one whose fresh records the draft got most wrong, in number;
an adapter with no version is due a round as soon as it can be trained and judged."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from trainer.replay import AdapterData
from trainer.schedule import expected_gain, first_version_due


def example(
    drafted: list[int], accepted: list[int], name: str = "e", model: list[bool] | None = None
) -> SimpleNamespace:
    """What the schedule reads of an example: its record's per-step drafted and accepted
    counts, which steps the draft model drafted (and, for the windows, its id and domain)."""
    record = SimpleNamespace(
        num_drafted=np.array(drafted),
        num_accepted=np.array(accepted),
        model_steps=np.array([True] * len(drafted) if model is None else model),
        domain="",
    )
    return SimpleNamespace(entry_id=name, record=record, arrived_at=0.0)


def test_gain_is_fresh_records_times_the_share_of_drafted_tokens_rejected():
    assert expected_gain([]) == 0.0
    assert expected_gain([example([4, 4], [1, 1])] * 10) == 10 * 0.75
    # A few records of a domain the draft knows nothing of outrank many it mostly gets right.
    new_domain = [example([4], [0])] * 8
    well_known = [example([4], [3])] * 24
    assert expected_gain(new_domain) > expected_gain(well_known)
    # Nothing drafted (speculation off): nothing says the draft was right.
    assert expected_gain([example([0], [0])] * 3) == 3.0
    # All accepted: a little room is left, so the adapter is not starved for good.
    assert 0.0 < expected_gain([example([4], [4])]) < 0.01
    # Steps a lookup drafted (suffix, ngram) say nothing of the draft model.
    mixed = example([4, 8, 4], [0, 8, 0], model=[True, False, True])
    assert expected_gain([mixed]) == expected_gain([example([4, 4], [0, 0])]) == 1.0


def test_first_version_is_due_with_enough_records_to_train_and_to_judge():
    data = AdapterData(replay_size=10, holdout_size=10, holdout_fraction=0.2, min_holdout=4)
    for i in range(7):
        data.add(example([4], [0], f"e-{i}"))
    assert not first_version_due(None, data, 4)  # 3 fresh, 4 held out
    data.add(example([4], [0], "e-7"))
    assert first_version_due(None, data, 4)
    assert not first_version_due(2, data, 4)  # it has a version: full rounds only
