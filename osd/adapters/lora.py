"""LoRA weights in and out of peft models, their safetensors codec, and the base-model hash.

The versioned store (`osd.versions`) moves bytes; this module, through the LoRA codec
(`osd.adapters.codec`), turns a peft adapter into checked safetensors bytes and back, and
installs checked weights into a peft model under a new adapter name, which the engine then
selects per request through peft's ``adapter_names`` forward kwarg.

Only safetensors is read: a weights file that is anything else (a pickle under a .safetensors
name, say) is refused before and by the safetensors parser; `torch.load` is never called.
Supported LoRA configurations are plain ones (one rank and alpha, no rsLoRA/DoRA, no patterns,
no modules_to_save, no bias), so that the manifest says everything a replica needs.

A version carries LoRA tensors only. With ``lm_head`` (or an embedding) among the target modules
peft would also save the frozen base layer by default ("save_embedding_layers"): the demo draft's
lm_head made 1.57 MB of each 1.96 MB version, identical in every one, and installing it would
overwrite the replica's own base weights. Versions stored that way still load: the base copy is
dropped on the way in.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import safetensors.torch
import torch
from torch import Tensor

from osd.adapters.manifest import AdapterManifest, AdapterSpec
from osd.versions.codec import check_payload, check_safetensors_frame
from osd.versions.errors import VersionIntegrityError

__all__ = [
    "adapter_spec",
    "base_model_hash",
    "check_lora_shapes",
    "decode_weights",
    "encode_weights",
    "install_adapter",
    "lora_shapes",
    "lora_state_dict",
]

# Config keys that do not change what the weights compute: bookkeeping, runtime switches, the
# dtype the checkpoint was loaded in, and token ids.
_VOLATILE_CONFIG_KEYS = frozenset(
    {
        "transformers_version", "dtype", "torch_dtype", "use_cache", "output_attentions",
        "output_hidden_states", "return_dict", "id2label", "label2id", "problem_type",
        "bos_token_id", "eos_token_id", "pad_token_id", "architectures",
    }
)  # fmt: skip
# Parameter-name parts peft adds around base weights (dropped) or for adapters (skipped).
_PEFT_WRAPPER_PARTS = frozenset({"base_layer", "original_module"})
_PEFT_ADAPTER_PREFIXES = ("lora_", "modules_to_save")


def _lora_rank_dim(key: str) -> int | None:
    """Which dim of a peft LoRA tensor is the rank: 0 for A, -1 for B, None for other keys."""
    parts = key.split(".")
    if "lora_A" in parts or "lora_embedding_A" in parts:
        return 0
    if "lora_B" in parts or "lora_embedding_B" in parts:
        return -1
    return None


def _is_base_copy(key: str) -> bool:
    """Whether `key` is a base-model weight peft saved beside the LoRA tensors."""
    return _lora_rank_dim(key) is None and bool(_PEFT_WRAPPER_PARTS & set(key.split(".")))


def _check_tensors(weights: Mapping[str, Tensor], rank: int) -> None:
    if not weights:
        raise VersionIntegrityError("adapter has no tensors", "not_lora")
    num_lora = 0
    for key, tensor in weights.items():
        if not isinstance(tensor, Tensor) or not tensor.is_floating_point():
            kind = getattr(tensor, "dtype", type(tensor).__name__)
            raise VersionIntegrityError(
                f"tensor {key!r} must be a floating tensor, got {kind}", "not_lora"
            )
        if not bool(torch.isfinite(tensor).all()):
            raise VersionIntegrityError(f"tensor {key!r} has NaN or infinite values", "non_finite")
        dim = _lora_rank_dim(key)
        if dim is None:
            continue
        num_lora += 1
        if tensor.dim() != 2 or tensor.shape[dim] != rank:
            raise VersionIntegrityError(
                f"tensor {key!r} has shape {tuple(tensor.shape)}, not that of a rank-{rank} LoRA",
                "shape_mismatch",
            )
    if num_lora == 0:
        raise VersionIntegrityError(f"no LoRA A/B tensors among {sorted(weights)[:4]}", "not_lora")


def check_lora_shapes(
    weights: Mapping[str, Tensor], expected_shapes: Mapping[str, Sequence[int]]
) -> None:
    """Checks that `weights` has exactly the keys and shapes of `expected_shapes`.

    Raises:
        VersionIntegrityError: naming missing or unexpected keys, or the first shape mismatch.
    """
    missing = sorted(set(expected_shapes) - set(weights))
    unexpected = sorted(set(weights) - set(expected_shapes))
    if missing or unexpected:
        raise VersionIntegrityError(
            f"adapter does not fit the expected LoRA layout: missing {missing[:3]} "
            f"({len(missing)}), unexpected {unexpected[:3]} ({len(unexpected)})",
            "shape_mismatch",
        )
    for key, shape in expected_shapes.items():
        if tuple(weights[key].shape) != tuple(shape):
            raise VersionIntegrityError(
                f"tensor {key!r} has shape {tuple(weights[key].shape)}, expected {tuple(shape)}",
                "shape_mismatch",
            )


def encode_weights(weights: Mapping[str, Tensor], rank: int) -> bytes:
    """Serialises LoRA weights (keys as `lora_state_dict` gives them) to safetensors bytes,
    after checking they are finite and of rank `rank`."""
    _check_tensors(weights, rank)
    tensors = {key: t.detach().to("cpu").contiguous().clone() for key, t in weights.items()}
    return safetensors.torch.save(tensors, metadata={"format": "pt"})


def decode_weights(
    manifest: AdapterManifest,
    payload: bytes,
    expected_shapes: Mapping[str, Sequence[int]] | None = None,
) -> dict[str, Tensor]:
    """Checks `payload` against `manifest` and parses it as safetensors (CPU tensors).

    Raises:
        VersionIntegrityError: wrong size (truncated), wrong sha256, not safetensors, non-finite
            values, rank other than the manifest's, or shapes other than `expected_shapes`.
    """
    check_payload(
        manifest.ref, payload, num_bytes=manifest.num_weight_bytes, sha256=manifest.weights_sha256
    )
    check_safetensors_frame(payload)
    try:
        weights = safetensors.torch.load(payload)
    except Exception as exc:  # the parser's own error type is not part of its API
        raise VersionIntegrityError(
            f"{manifest.ref}: weights are not valid safetensors: {exc}", "not_safetensors"
        ) from exc
    _check_tensors(weights, manifest.rank)
    weights = {k: v for k, v in weights.items() if not _is_base_copy(k)}
    if expected_shapes is not None:
        check_lora_shapes(weights, expected_shapes)
    return weights


def _base_parameters(model: torch.nn.Module) -> list[tuple[str, Tensor]]:
    """The base model's parameters under their un-wrapped names, whether peft wraps it or not."""
    get_base_model = getattr(model, "get_base_model", None)
    base: torch.nn.Module = get_base_model() if callable(get_base_model) else model
    params = []
    for name, param in base.named_parameters():
        parts = name.split(".")
        if any(part.startswith(_PEFT_ADAPTER_PREFIXES) for part in parts):
            continue
        params.append((".".join(p for p in parts if p not in _PEFT_WRAPPER_PARTS), param))
    return sorted(params, key=lambda item: item[0])


def base_model_hash(model: torch.nn.Module, *, num_samples: int = 8) -> str:
    """A stable fingerprint of a base draft model, so adapters of a foreign base are refused.

    Hashes the model config (minus `_VOLATILE_CONFIG_KEYS` and private keys), every base
    parameter's name and shape, and `num_samples` evenly strided values of each parameter. The
    values are rounded to bfloat16 first, so fp32 and bf16 copies of one checkpoint agree (an fp16
    copy may not). LoRA parameters and peft's wrapping are ignored: a model hashes the same with
    or without adapters.

    Returns:
        64 lowercase hex digits (sha256).
    """
    digest = hashlib.sha256()
    config = getattr(model, "config", None)
    config_dict = config.to_dict() if config is not None else {}
    kept = {
        k: v
        for k, v in config_dict.items()
        if k not in _VOLATILE_CONFIG_KEYS and not k.startswith("_")
    }
    digest.update(json.dumps(kept, sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, param in _base_parameters(model):
            digest.update(f"{name}:{tuple(param.shape)};".encode())
            flat = param.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // num_samples)][:num_samples]
            digest.update(sample.to(torch.bfloat16).view(torch.int16).cpu().numpy().tobytes())
    return digest.hexdigest()


def _lora_config(peft_model: Any, adapter_name: str) -> Any:
    configs = getattr(peft_model, "peft_config", None)
    if not isinstance(configs, dict) or adapter_name not in configs:
        known = sorted(configs) if isinstance(configs, dict) else "none (not a peft model)"
        raise ValueError(f"unknown adapter {adapter_name!r}; the model has {known}")
    return configs[adapter_name]


def adapter_spec(peft_model: Any, adapter_name: str, base_model_id: str) -> AdapterSpec:
    """The `AdapterSpec` of one LoRA adapter of a peft model, for the store's `publish(spec=...)`.

    Raises:
        ValueError: unknown adapter, or a LoRA option the store does not carry.
    """
    config = _lora_config(peft_model, adapter_name)
    unsupported = {
        "use_rslora": bool(getattr(config, "use_rslora", False)),
        "use_dora": bool(getattr(config, "use_dora", False)),
        "rank_pattern": bool(getattr(config, "rank_pattern", None)),
        "alpha_pattern": bool(getattr(config, "alpha_pattern", None)),
        "modules_to_save": bool(getattr(config, "modules_to_save", None)),
        "layers_to_transform": getattr(config, "layers_to_transform", None) is not None,
        "fan_in_fan_out": bool(getattr(config, "fan_in_fan_out", False)),
        "bias": getattr(config, "bias", "none") != "none",
    }
    used = sorted(key for key, on in unsupported.items() if on)
    if used:
        raise ValueError(
            f"adapter {adapter_name!r} uses LoRA options the store cannot carry: {used}"
        )
    return AdapterSpec(
        base_model_id=base_model_id,
        base_model_hash=base_model_hash(peft_model),
        rank=int(config.r),
        lora_alpha=float(config.lora_alpha),
        target_modules=config.target_modules,
    )


def lora_state_dict(peft_model: Any, adapter_name: str) -> dict[str, Tensor]:
    """Detached CPU copies of one adapter's LoRA tensors, keyed without the adapter name."""
    from peft import get_peft_model_state_dict

    _lora_config(peft_model, adapter_name)
    state = get_peft_model_state_dict(
        peft_model, adapter_name=adapter_name, save_embedding_layers=False
    )
    return {key: value.detach().to("cpu").clone() for key, value in state.items()}


def lora_shapes(peft_model: Any, adapter_name: str) -> dict[str, tuple[int, ...]]:
    """The key -> shape layout of one adapter, for the store's `load(expected_shapes=...)`."""
    from peft import get_peft_model_state_dict

    _lora_config(peft_model, adapter_name)
    state = get_peft_model_state_dict(
        peft_model, adapter_name=adapter_name, save_embedding_layers=False
    )
    return {key: tuple(value.shape) for key, value in state.items()}


def install_adapter(
    peft_model: Any,
    adapter_name: str,
    manifest: AdapterManifest,
    weights: Mapping[str, Tensor],
    *,
    trainable: bool = False,
) -> None:
    """Adds `weights` to `peft_model` as a new adapter `adapter_name`, not made active.

    The base model must hash as the manifest says, and the weights must fit exactly the layout
    peft builds for the manifest's rank and target modules; on any failure the half-added adapter
    is deleted again. A live adapter is never overwritten: install each version under its own
    name (e.g. ``"code-v7"``), switch requests to it, then `delete_adapter` the old one.

    Raises:
        ValueError: `adapter_name` exists already or is not a valid module key.
        VersionIntegrityError: foreign base model, or shapes that do not fit.
    """
    from peft import LoraConfig, set_peft_model_state_dict

    if adapter_name in getattr(peft_model, "peft_config", {}):
        raise ValueError(f"adapter {adapter_name!r} already exists; install under a new name")
    if not adapter_name or "." in adapter_name:
        raise ValueError(f"peft adapter names must be non-empty without '.', got {adapter_name!r}")
    if base_model_hash(peft_model) != manifest.base_model_hash:
        raise VersionIntegrityError(
            f"{manifest.ref} was trained on another base model", "base_model_mismatch"
        )
    targets = manifest.target_modules
    # peft annotates lora_alpha as int but computes lora_alpha / r; keep integral values ints.
    alpha: Any = (
        int(manifest.lora_alpha) if manifest.lora_alpha.is_integer() else manifest.lora_alpha
    )
    config = LoraConfig(
        r=manifest.rank,
        lora_alpha=alpha,
        target_modules=list(targets) if isinstance(targets, tuple) else targets,
        lora_dropout=0.0,
        inference_mode=not trainable,
    )
    peft_model.add_adapter(adapter_name, config)
    try:
        check_lora_shapes(weights, lora_shapes(peft_model, adapter_name))
        result = set_peft_model_state_dict(peft_model, dict(weights), adapter_name=adapter_name)
        unexpected = list(getattr(result, "unexpected_keys", []))
        if unexpected:
            raise VersionIntegrityError(f"peft did not use keys {unexpected[:3]}", "shape_mismatch")
    except BaseException:
        peft_model.delete_adapter(adapter_name)
        raise
    for name, param in peft_model.named_parameters():
        if f".{adapter_name}." in name:
            param.requires_grad_(trainable)
