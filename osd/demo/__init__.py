"""Offline demo models and multi-domain workloads: real language without downloads.

A Llama target trained on six domains (prose and code from the Python standard library,
generated SQL, arithmetic word problems and JSON, and chat dialogues over them) and a much
smaller Llama draft trained on prose only, sharing a byte-level BPE tokenizer with a chat
template, built reproducibly into a cache in minutes on 2 CPU cores. The draft starts out poor
on the non-prose domains: the headroom online distillation recovers. See docs/demo_models.md.

    from osd.demo import build_demo_models
    paths = build_demo_models()          # cached after the first call
    engine = SpeculativeDecoder(str(paths.target), str(paths.draft))
"""

from osd.demo.build import (
    DemoModelPaths,
    build_demo_models,
    default_cache_dir,
    demo_models_root,
)
from osd.demo.chat import CHAT_TEMPLATE, parse_chat, render_chat
from osd.demo.corpus import heldout_dialogues, heldout_prompts, load_corpus_split
from osd.demo.recipe import DOMAINS, TEXT_DOMAINS, Recipe, recipe_for
from osd.demo.workload import (
    WorkloadItem,
    load_workload,
    make_workload,
    parse_schedule,
    write_workload,
)

__all__ = [
    "CHAT_TEMPLATE",
    "DOMAINS",
    "TEXT_DOMAINS",
    "DemoModelPaths",
    "Recipe",
    "WorkloadItem",
    "build_demo_models",
    "default_cache_dir",
    "demo_models_root",
    "heldout_dialogues",
    "heldout_prompts",
    "load_corpus_split",
    "load_workload",
    "make_workload",
    "parse_chat",
    "parse_schedule",
    "recipe_for",
    "render_chat",
    "write_workload",
]
