"""osd.routing: prompt features and the routing model (pure), and its fit on separable topics."""

from __future__ import annotations

import numpy as np
import pytest

from osd.routing import RoutingModel, fit_routing_model, prompt_features, stack_features
from osd.routing.model import MAX_MODEL_BYTES


def topic_prompts(rng: np.random.Generator, low: int, high: int, count: int) -> list[list[int]]:
    """Prompts whose tokens come from one range of ids (a topic), plus shared common tokens."""
    return [
        [*rng.integers(low, high, size=8).tolist(), *rng.integers(0, 4, size=4).tolist()]
        for _ in range(count)
    ]


def test_features_are_unit_vectors_the_same_in_every_call_and_order_aware():
    a = prompt_features([5, 6, 7, 8])
    assert a.shape == (1024,) and a.dtype == np.float32
    assert np.linalg.norm(a) == pytest.approx(1.0, abs=1e-6)
    np.testing.assert_array_equal(a, prompt_features(np.array([5, 6, 7, 8])))
    assert not np.array_equal(a, prompt_features([8, 7, 6, 5]))  # token pairs count
    assert not prompt_features([]).any()
    with pytest.raises(ValueError, match="1-D"):
        prompt_features([[1, 2]])
    # Huge ids hash without overflow errors; a long prompt costs a bounded amount.
    assert np.isfinite(prompt_features([2**40, 2**62, 7] * 2000)).all()


def test_the_model_learns_topics_from_few_labels_and_generalises():
    rng = np.random.default_rng(0)
    names = ["general", "code", "sql"]
    ranges = {"general": (4, 60), "code": (60, 120), "sql": (120, 180)}
    train = {n: topic_prompts(rng, *r, 24) for n, r in ranges.items()}
    test = {n: topic_prompts(rng, *r, 50) for n, r in ranges.items()}
    features = np.concatenate([stack_features(train[n]) for n in names])
    labels = [n for n in names for _ in range(24)]
    model = fit_routing_model(features, labels, names)
    for name in names:
        chosen = model.choices(stack_features(test[name]))
        assert np.mean([c == name for c in chosen]) >= 0.9
    adapter, probability = model.predict(test["code"][0])
    assert adapter == "code" and 0.5 < probability <= 1.0


def test_a_class_without_labels_is_never_chosen():
    rng = np.random.default_rng(1)
    features = stack_features(topic_prompts(rng, 4, 60, 10))
    model = fit_routing_model(features, ["general"] * 10, ["general", "code"])
    assert set(model.choices(features)) == {"general"}


def test_the_model_round_trips_through_safetensors_and_refuses_anything_else():
    rng = np.random.default_rng(2)
    features = stack_features(topic_prompts(rng, 4, 60, 6) + topic_prompts(rng, 60, 120, 6))
    model = fit_routing_model(features, ["general"] * 6 + ["code"] * 6, ["general", "code"])
    again = RoutingModel.from_bytes(model.to_bytes())
    assert again.classes == model.classes
    np.testing.assert_array_equal(again.weights, model.weights)
    np.testing.assert_array_equal(again.bias, model.bias)
    with pytest.raises(ValueError, match="not a safetensors file"):
        RoutingModel.from_bytes(b"\x80\x04pickle")
    with pytest.raises(ValueError, match="over"):
        RoutingModel.from_bytes(b"0" * (MAX_MODEL_BYTES + 1))


def test_bad_models_and_fits_are_refused_with_clear_errors():
    weights, bias = np.zeros((2, 8), np.float32), np.zeros(2, np.float32)
    with pytest.raises(ValueError, match="distinct"):
        RoutingModel(("a", "a"), weights, bias)
    with pytest.raises(ValueError, match="finite"):
        RoutingModel(("a", "b"), np.full((2, 8), np.nan, np.float32), bias)
    with pytest.raises(ValueError, match="bias"):
        RoutingModel(("a", "b"), weights, np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="not among the classes"):
        fit_routing_model(np.zeros((1, 8), np.float32), ["x"], ["a"])
    with pytest.raises(ValueError, match="N >= 1"):
        fit_routing_model(np.zeros((0, 8), np.float32), [], ["a"])
