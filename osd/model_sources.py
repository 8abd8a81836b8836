"""Where a deployment's models come from: hub ids and local paths, or the offline pairs.

``toy:target`` / ``toy:draft`` are tiny random models built in code (tests, smoke runs);
``demo:target`` / ``demo:draft`` are the trained offline demo pair (``osd demo-models build``).
Anything else is a local path or a Hugging Face hub id.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import PreTrainedModel

from osd.config import ConfigError, ModelConfig, resolve_device, resolve_dtype
from osd.decode.models import load_causal_lm, load_tokenizer

__all__ = [
    "attach_lora_adapters",
    "find_demo_models",
    "load_draft",
    "load_model_pair",
]


def _toy_pair() -> tuple[PreTrainedModel, PreTrainedModel, Any]:
    from osd.toy_models import char_tokenizer, noisy_copy, tiny_llama

    target = tiny_llama(
        vocab_size=64, hidden_size=64, num_layers=2, seed=0, logit_scale=4.0, eos_token_id=1
    )
    return target, noisy_copy(target, 0.1, seed=1), char_tokenizer()


def _demo_paths() -> Any:
    """The demo pair's paths, building it first if this machine has not yet (minutes)."""
    from osd.demo import build_demo_models

    return build_demo_models(progress=True)


def find_demo_models() -> Any:
    """The demo pair's paths if it is already built for the current recipe, else None."""
    from osd.demo import build_demo_models, demo_models_root

    if not (demo_models_root() / "draft" / "config.json").exists():
        return None
    return build_demo_models(progress=False)  # built: only checks the recipe's manifests


def _is_toy(config: ModelConfig) -> bool:
    return config.target.startswith("toy:") or config.draft.startswith("toy:")


def _sources(config: ModelConfig) -> dict[str, str]:
    """Paths or hub ids of target, draft and tokenizer, with ``demo:`` names resolved."""
    sources = {"target": config.target, "draft": config.draft, "tokenizer": config.target}
    if config.uses_demo_models:
        paths = _demo_paths()
        sources = {
            k: str(getattr(paths, v.split(":", 1)[1], v)) if v.startswith("demo:") else v
            for k, v in sources.items()
        }
        sources["tokenizer"] = str(paths.tokenizer)
    return sources


def load_model_pair(config: ModelConfig) -> tuple[PreTrainedModel, PreTrainedModel, Any]:
    """Loads (target, base draft, tokenizer) on the configured device and dtype."""
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    target: PreTrainedModel | str
    draft: PreTrainedModel | str
    if _is_toy(config):
        target, draft, tokenizer = _toy_pair()
    else:
        sources = _sources(config)
        target, draft = sources["target"], sources["draft"]
        tokenizer = load_tokenizer(config.tokenizer or sources["tokenizer"])
    if config.chat_template:
        tokenizer.chat_template = read_chat_template(config.chat_template)
    return (
        load_causal_lm(target, device=device, dtype=dtype),
        load_causal_lm(draft, device=device, dtype=dtype),
        tokenizer,
    )


def read_chat_template(source: str) -> str:
    """A chat template given as the template's text (it holds ``{%`` or ``{{``) or a file path.

    Raises:
        ConfigError: a path that cannot be read.
    """
    if "{%" in source or "{{" in source:
        return source
    try:
        return Path(source).expanduser().read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"model.chat_template: cannot read {source!r}: {exc}") from None


def attach_lora_adapters(draft: PreTrainedModel, config: ModelConfig, names: list[str]) -> Any:
    """Wraps the base draft in peft with one identity-initialised LoRA adapter per name.

    A fresh adapter leaves the draft unchanged (LoRA's B starts at zero); published versions
    replace it later.
    """
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=config.lora_rank,
        lora_alpha=config.lora_alpha,
        target_modules=list(config.lora_target_modules),
    )
    model = get_peft_model(draft, lora, adapter_name=names[0])
    for name in names[1:]:
        model.add_adapter(name, lora)
    return model.eval()


def load_draft(
    config: ModelConfig, *, device: str | None = None, dtype: str | None = None
) -> tuple[PreTrainedModel, str]:
    """Loads only the base draft (the trainer's model), never the target's weights.

    ``toy:`` pairs are built in code, where the toy draft is derived from the toy target, so the
    tiny toy target is built and dropped; real drafts are read from their path or hub id.

    Args:
        config: the model section; ``device``/``dtype`` default to its own.
        device: e.g. ``"cuda"``; ``auto`` or None resolves as `resolve_device`.
        dtype: e.g. ``"float32"``; ``auto`` or None resolves as `resolve_dtype`.

    Returns:
        ``(draft, source)``: the draft in eval mode and the path, hub id or toy name it came
        from (an adapter manifest's ``base_model_id``).
    """
    device = resolve_device(device or config.device)
    dtype = resolve_dtype(dtype or config.dtype, device)
    if _is_toy(config):
        _, draft, _ = _toy_pair()
        return load_causal_lm(draft, device=device, dtype=dtype), config.draft
    source = _sources(config)["draft"]
    return load_causal_lm(source, device=device, dtype=dtype), source
