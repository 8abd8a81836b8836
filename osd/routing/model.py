"""The content router's model: which draft adapter a prompt should get, from its features.

A multinomial logistic regression over `osd.routing.features` (one weight row and bias per
adapter). The trainer fits it on logged records, each labelled with the adapter whose draft the
target would have accepted most (`trainer.routing`); replicas ask it for requests that carry no
`domain` and no `draft` (`serving.router`). It is tiny (adapters x 1024 floats) and predicting is
one matrix-vector product.

On the wire it is a safetensors file (never pickle): tensors ``weights`` (C, D) and ``bias``
(C,), with the adapter names and the feature size in the safetensors metadata. `from_bytes`
checks everything it reads. Pure: numpy and safetensors.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from safetensors.numpy import load as load_safetensors
from safetensors.numpy import save as save_safetensors

from osd.routing.features import prompt_features

__all__ = ["MAX_MODEL_BYTES", "RoutingModel", "fit_routing_model"]

MAX_MODEL_BYTES = 16 * 2**20
FORMAT = "osd-routing-1"


def _softmax(logits: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    exp = np.exp(shifted)
    return (exp / exp.sum(axis=-1, keepdims=True)).astype(np.float32)


@dataclass(frozen=True, eq=False)
class RoutingModel:
    """Adapter probabilities from prompt features.

    Attributes:
        classes: adapter names, one per weight row.
        weights: (C, D) float32.
        bias: (C,) float32.
    """

    classes: tuple[str, ...]
    weights: npt.NDArray[np.float32]
    bias: npt.NDArray[np.float32]

    def __post_init__(self) -> None:
        classes = tuple(self.classes)
        if not classes or len(set(classes)) != len(classes):
            raise ValueError(f"classes must be distinct adapter names, got {classes!r:.120}")
        if any(not isinstance(c, str) or not c or not c.isprintable() for c in classes):
            raise ValueError(f"classes must be printable names, got {classes!r:.120}")
        weights = np.ascontiguousarray(self.weights, dtype=np.float32)
        bias = np.ascontiguousarray(self.bias, dtype=np.float32)
        if weights.ndim != 2 or weights.shape[0] != len(classes) or weights.shape[1] < 2:
            raise ValueError(f"weights must be ({len(classes)}, D >= 2), got {weights.shape}")
        if bias.shape != (len(classes),):
            raise ValueError(f"bias must be ({len(classes)},), got {bias.shape}")
        if not (np.isfinite(weights).all() and np.isfinite(bias).all()):
            raise ValueError("routing model weights must be finite")
        weights.setflags(write=False)
        bias.setflags(write=False)
        object.__setattr__(self, "classes", classes)
        object.__setattr__(self, "weights", weights)
        object.__setattr__(self, "bias", bias)

    @property
    def dim(self) -> int:
        return int(self.weights.shape[1])

    def probabilities(self, features: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """(N, C) adapter probabilities of (N, D) features (or (C,) of one (D,) vector)."""
        return _softmax(features @ self.weights.T + self.bias)

    def predict(self, token_ids: Sequence[int] | npt.NDArray[np.integer]) -> tuple[str, float]:
        """The most likely adapter for a prompt and its probability."""
        probs = self.probabilities(prompt_features(token_ids, self.dim))
        best = int(np.argmax(probs))
        return self.classes[best], float(probs[best])

    def choices(self, features: npt.NDArray[np.float32]) -> list[str]:
        """The most likely adapter of each row of (N, D) features."""
        return [self.classes[i] for i in np.argmax(self.probabilities(features), axis=-1)]

    def to_bytes(self) -> bytes:
        """A safetensors file: the weights, and the class names in its metadata."""
        metadata = {"format": FORMAT, "classes": json.dumps(list(self.classes))}
        return save_safetensors(
            {"weights": np.asarray(self.weights), "bias": np.asarray(self.bias)}, metadata
        )

    @classmethod
    def from_bytes(cls, payload: bytes) -> RoutingModel:
        """Reads `to_bytes`' output, checking size, format, names and shapes.

        Raises:
            ValueError: anything else.
        """
        if len(payload) > MAX_MODEL_BYTES:
            raise ValueError(f"routing model of {len(payload)} bytes, over {MAX_MODEL_BYTES}")
        try:
            header_len = int.from_bytes(payload[:8], "little")
            header = json.loads(payload[8 : 8 + header_len])
            tensors = load_safetensors(payload)
        except Exception as exc:  # noqa: BLE001 - any parse failure is the same refusal
            raise ValueError(f"routing model is not a safetensors file: {exc}") from exc
        metadata = header.get("__metadata__") or {}
        if metadata.get("format") != FORMAT or set(tensors) != {"weights", "bias"}:
            raise ValueError(f"not a routing model (format {metadata.get('format')!r})")
        try:
            classes = json.loads(metadata["classes"])
        except (KeyError, json.JSONDecodeError) as exc:
            raise ValueError(f"routing model without class names: {exc}") from exc
        if not isinstance(classes, list):
            raise ValueError("routing model class names must be a list")
        return cls(tuple(classes), tensors["weights"], tensors["bias"])


def fit_routing_model(
    features: npt.NDArray[np.float32],
    labels: Sequence[str],
    classes: Sequence[str],
    *,
    steps: int = 200,
    learning_rate: float = 4.0,
    l2: float = 1e-3,
) -> RoutingModel:
    """Multinomial logistic regression by full-batch gradient descent (measured on 2 cores: 13,
    46 and 125 ms for 64, 256 and 768 records; docs/trainer.md).

    Args:
        features: (N, D) prompt features.
        labels: N adapter names, each among `classes`.
        classes: the adapters the model chooses among (a class no label names keeps a low bias).
        steps, learning_rate, l2: the descent; features are unit vectors, so one rate fits all.

    Raises:
        ValueError: no records, a shape mismatch, or a label outside `classes`.
    """
    classes = tuple(classes)
    index = {name: i for i, name in enumerate(classes)}
    if features.ndim != 2 or len(features) != len(labels) or not len(labels):
        raise ValueError(
            f"need (N >= 1, D) features and N labels, got {features.shape} and {len(labels)}"
        )
    unknown = sorted(set(labels) - set(index))
    if unknown:
        raise ValueError(f"labels {unknown} are not among the classes {list(classes)}")
    x = features.astype(np.float32)
    y = np.zeros((len(labels), len(classes)), dtype=np.float32)
    y[np.arange(len(labels)), [index[label] for label in labels]] = 1.0
    weights = np.zeros((len(classes), x.shape[1]), dtype=np.float32)
    prior = (y.sum(axis=0) + 0.1) / (len(labels) + 0.1 * len(classes))
    bias = np.log(prior).astype(np.float32)
    for _ in range(steps):
        error = (_softmax(x @ weights.T + bias) - y) / len(labels)  # (N, C)
        weights -= learning_rate * (error.T @ x + l2 * weights)
        bias -= learning_rate * error.sum(axis=0)
    return RoutingModel(classes, weights, bias)
