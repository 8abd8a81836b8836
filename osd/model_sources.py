"""Where a deployment's models come from: hub ids and local paths, or the offline pairs.

``toy:target`` / ``toy:draft`` are tiny random models built in code (tests, smoke runs);
``demo:target`` / ``demo:draft`` are the trained offline demo pair (``osd demo-models build``).
Anything else is a local path or a Hugging Face hub id.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedModel

from osd.config import ModelConfig, resolve_device, resolve_dtype
from osd.models import load_causal_lm, load_tokenizer

__all__ = ["attach_lora_adapters", "load_model_pair"]


def _toy_pair() -> tuple[PreTrainedModel, PreTrainedModel, Any]:
    from osd.testing import char_tokenizer, noisy_copy, tiny_llama

    target = tiny_llama(
        vocab_size=64, hidden_size=64, num_layers=2, seed=0, logit_scale=4.0, eos_token_id=1
    )
    return target, noisy_copy(target, 0.1, seed=1), char_tokenizer()


def _demo_paths() -> Any:
    from osd.demo import find_demo_models  # type: ignore[attr-defined]

    paths = find_demo_models()
    if paths is None:
        raise ValueError("demo models are not built yet: run `osd demo-models build` first")
    return paths


def load_model_pair(config: ModelConfig) -> tuple[PreTrainedModel, PreTrainedModel, Any]:
    """Loads (target, base draft, tokenizer) on the configured device and dtype."""
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    target: PreTrainedModel | str
    draft: PreTrainedModel | str
    if config.target.startswith("toy:") or config.draft.startswith("toy:"):
        target, draft, tokenizer = _toy_pair()
    else:
        sources = {"target": config.target, "draft": config.draft}
        if config.target.startswith("demo:") or config.draft.startswith("demo:"):
            paths = _demo_paths()
            sources = {
                k: str(getattr(paths, v.split(":", 1)[1], v)) if v.startswith("demo:") else v
                for k, v in sources.items()
            }
        target, draft = sources["target"], sources["draft"]
        tokenizer = load_tokenizer(config.tokenizer or target)
    return (
        load_causal_lm(target, device=device, dtype=dtype),
        load_causal_lm(draft, device=device, dtype=dtype),
        tokenizer,
    )


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
