"""Configuration: frozen dataclasses are the schema, YAML holds the values.

One loader (:func:`load_config`) reads a YAML file, applies ``a.b=value`` overrides, rejects
unknown keys and converts values to the annotated types, with errors that name the field and the
bad value. Device and dtype default to ``auto``: CUDA and bfloat16 where a GPU is present, CPU
and float32 elsewhere, so nothing hard-codes the CPU.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from osd.config_convert import config_from_dict
from osd.decode.limits import MAX_DRAFTS, MAX_SPEC_TOKENS
from osd.decode.methods import PROPOSER_CHOICES, Method, ProposerChoice

__all__ = [
    "BUILTIN_CONFIGS",
    "AdapterConfig",
    "ConfigError",
    "LogConfig",
    "ModelConfig",
    "OSDConfig",
    "RoutingConfig",
    "ServeConfig",
    "SpecConfig",
    "TrainerConfig",
    "WandbConfig",
    "config_from_dict",
    "config_path",
    "is_loopback",
    "load_config",
    "resolve_device",
    "resolve_dtype",
]


class ConfigError(ValueError):
    """A config that cannot be used: the message names the file (if any) and the problem."""


@dataclass(frozen=True)
class ModelConfig:
    """The target/draft pair and the draft's LoRA adapters."""

    target: str = "demo:target"  # path, hub id, or demo:target / demo:draft (built offline)
    draft: str = "demo:draft"
    tokenizer: str = ""  # empty: the target's
    # The chat template (vLLM's --chat-template): a Jinja file's path, or the template itself
    # (text holding "{%" or "{{"); empty: the tokenizer's own.
    chat_template: str = ""
    device: str = "auto"  # auto: cuda if available, else cpu
    dtype: str = "auto"  # auto: bfloat16 on cuda, float32 on cpu
    adapters: tuple[str, ...] = ("general",)  # LoRA adapters attached to the draft
    lora_rank: int = 8
    lora_alpha: int = 16
    lora_target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    # Slot-cache forwards of Llama-shaped families (Llama, Mistral, Qwen2/3) through osd's lean
    # forward (osd.decode.lean_forward); false: transformers' own forward, for debugging.
    lean_forward: bool = True
    # The lean forward's decode layers through torch.compile (osd.decode.compiled_forward):
    # faster steps (the demo target alone 1.30-1.67x eager at batch 1, 1.35-1.38x at 16,
    # 2026-12-05), compiled during the replica's warm-up, before it reports ready (100-180 s
    # on a 2-core AMD EPYC the first time, 227-333 s on a 2-core Intel Xeon, 45-60 s to ready
    # from inductor's on-disk cache after; vLLM's CPU server was ready in 43-81 s on those
    # machines). A LoRA draft's adapters run the graphs its plain weights compiled; on the CPU
    # each shape class keeps whichever of compiled and eager timed faster in its first calls
    # (osd.decode.compiled_forward). A compilation that fails
    # (no C++ compiler, say) leaves that model eager, with a warning. False: the eager forward,
    # the debugging switch. The default is true unless OSD_MODEL_COMPILE=0 is set (the test
    # suite sets it; a config's own value wins over both).
    compile: bool = field(default_factory=lambda: _env_flag("OSD_MODEL_COMPILE", default=True))
    # On CUDA, those decode layers (compiled or not) replay CUDA graphs captured per batch
    # bucket (osd.decode.cuda_graphs), merged draft forwards' too; no effect on the CPU. Off by
    # default: a capture while another thread copies between host and GPU fails that copy.
    cuda_graphs: bool = False
    # Draft forwards whose rows all run one adapter run it merged into plain weights
    # (osd.decode.models): this many adapters' merged weights are kept, each a copy of the
    # draft weights its LoRA touches; 0: every draft forward runs its adapters per row.
    merged_drafts: int = 4

    def __post_init__(self) -> None:
        _require(bool(self.target), "model.target", self.target, "a path or hub id")
        _require(self.merged_drafts >= 0, "model.merged_drafts", self.merged_drafts, ">= 0")
        _require(bool(self.draft), "model.draft", self.draft, "a path or hub id")
        _require(self.lora_rank >= 1, "model.lora_rank", self.lora_rank, ">= 1")
        _require(bool(self.adapters), "model.adapters", self.adapters, "at least one name")

    @property
    def uses_demo_models(self) -> bool:
        """Target or draft is one of the demo models (``demo:...``), built offline on first use."""
        return self.target.startswith("demo:") or self.draft.startswith("demo:")


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding defaults; requests may override method, k and K."""

    method: Method = "block"
    # k for requests that name none: "auto" (the goodput controller chooses it per request and
    # step, in 0..max_spec_tokens, from measured acceptance and step costs) or a fixed k >= 1.
    num_spec_tokens: int | Literal["auto"] = "auto"
    num_drafts: int = 2
    adaptive_threshold: float = 0.0
    log_top_m: int = 32
    max_spec_tokens: int = 8
    # The most tokens a looked-up draft (suffix, ngram) verifies a step under "auto" k, apart
    # from the draft model's max_spec_tokens: a lookup costs no draft forward, only its
    # positions in the target's verify, and the controller takes the prefix worth its cost
    # (vLLM's suffix decoding drafts up to 16). Up to 15 a row's verify stays in the compiled
    # graphs' few-token path. 15 bought nothing measurable over 8 in process on repetitive
    # traffic (docs/benchmarks.md), so 8 stays the default.
    max_lookup_tokens: int = 8
    # Who drafts for requests that name none (osd.decode.proposers): "auto" (the controller picks
    # the draft model or a looked-up continuation per row and step), "draft", "suffix", "ngram".
    proposer: ProposerChoice = "auto"
    # Tokens of finished requests suffix decoding looks continuations up in, per replica
    # (oldest forgotten first; ~100 bytes a token, docs/benchmarks.md); 0: none kept.
    suffix_budget_tokens: int = 500_000
    # "global": one store for all requests; "route": one per route (domain), each this budget.
    suffix_scope: Literal["global", "route"] = "global"
    # Warm the store at start from this many of the newest logged records (0: start cold).
    suffix_warm_records: int = 2_000

    def __post_init__(self) -> None:
        _require(
            self.num_spec_tokens == "auto"
            or (
                isinstance(self.num_spec_tokens, int)
                and 1 <= self.num_spec_tokens <= MAX_SPEC_TOKENS
            ),
            "spec.num_spec_tokens",
            self.num_spec_tokens,
            f'"auto" or in 1..{MAX_SPEC_TOKENS}',
        )
        _require(
            1 <= self.num_drafts <= MAX_DRAFTS,
            "spec.num_drafts",
            self.num_drafts,
            f"in 1..{MAX_DRAFTS}",
        )
        _require(
            0 <= self.adaptive_threshold < 1,
            "spec.adaptive_threshold",
            self.adaptive_threshold,
            "in [0, 1)",
        )
        _require(self.log_top_m >= 1, "spec.log_top_m", self.log_top_m, ">= 1")
        _require(
            self.proposer in PROPOSER_CHOICES,
            "spec.proposer",
            self.proposer,
            f"one of {list(PROPOSER_CHOICES)}",
        )
        _require(
            self.suffix_budget_tokens >= 0,
            "spec.suffix_budget_tokens",
            self.suffix_budget_tokens,
            ">= 0",
        )
        _require(
            self.suffix_scope in ("global", "route"),
            "spec.suffix_scope",
            self.suffix_scope,
            '"global" or "route"',
        )
        _require(
            self.suffix_warm_records >= 0,
            "spec.suffix_warm_records",
            self.suffix_warm_records,
            ">= 0",
        )
        _require(
            1 <= self.max_spec_tokens <= MAX_SPEC_TOKENS,
            "spec.max_spec_tokens",
            self.max_spec_tokens,
            f"in 1..{MAX_SPEC_TOKENS}",
        )
        _require(
            1 <= self.max_lookup_tokens <= MAX_SPEC_TOKENS,
            "spec.max_lookup_tokens",
            self.max_lookup_tokens,
            f"in 1..{MAX_SPEC_TOKENS}",
        )


@dataclass(frozen=True)
class LogConfig:
    """The Redis log buffer between replicas and the trainer."""

    redis_url: str = ""  # empty: start a local redis-server (embedded default)
    stream: str = "osd:records"
    maxlen: int = 200_000
    # Redis memory the stream may take (bytes); 0: bound by maxlen only (docs/capacity.md).
    max_bytes: int = 0
    queue_size: int = 10_000
    enabled: bool = True

    def __post_init__(self) -> None:
        _require(self.maxlen >= 1, "log.maxlen", self.maxlen, ">= 1")
        _require(self.max_bytes >= 0, "log.max_bytes", self.max_bytes, ">= 0")
        _require(self.queue_size >= 1, "log.queue_size", self.queue_size, ">= 1")


@dataclass(frozen=True)
class ServeConfig:
    """The Ray Serve application."""

    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str = "osd"
    num_replicas: int = 1
    max_ongoing_requests: int = 32
    max_queued_requests: int = 32
    # The replica's decode loop (vLLM's names): requests decoded together per step, prompt
    # tokens prefilled per step, KV slots per model (0: max_num_seqs; a spectr request takes
    # num_drafts), positions per sequence (0: the models' context length).
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    kv_slots: int = 0
    max_model_len: int = 0
    # A joining prompt that begins as a decoding row's or a free slot's last row's did (8
    # tokens or more) copies those positions' KV rather than prefilling them (vLLM's name;
    # osd.decode.prefix_reuse). Off: every prompt is prefilled whole.
    enable_prefix_caching: bool = True
    # With kv_slots 0, KV slots from memory instead (vLLM's gpu_memory_utilization): the replica
    # may fill this share of its device's memory (weights, activations and caches; on the CPU,
    # the machine's RAM), or give the caches kv_cache_memory_bytes outright. 0: neither.
    gpu_memory_utilization: float = 0.0
    kv_cache_memory_bytes: int = 0
    # torch intra-op threads of the decode loop; 0: every core the replica may use.
    torch_threads: int = 0
    # The replica process's GIL switch interval (Python's sys.setswitchinterval; its own
    # default is 5 ms). The decode thread shares the GIL with the HTTP event loop: each time
    # a kernel lets the GIL go, the loop may take it, and the decode thread then waited up to
    # the whole interval for it back. At 16 streamed clients on 2 cores, target alone: 0.5 ms
    # streamed 1,257 tok/s (mean of 6 cells) against 1,094 at 5 ms; whole answers unchanged
    # (docs/benchmarks.md, twentieth session). 0: leave Python's.
    gil_switch_interval_ms: float = 0.5
    # Run each batch size's steps once before the replica reports ready (osd.decode.warmup):
    # the first forwards of a shape are slow; without it the first clients pay for them.
    warmup: bool = True
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    max_tokens_limit: int = 1024
    max_body_bytes: int = 1_000_000
    request_timeout_s: float = 120.0
    # Bearer keys every /v1/* route requires (empty: none). OSD_API_KEYS (comma-separated, e.g.
    # from a compose .env) fills them when the config names none. /health and /metrics stay open.
    api_keys: tuple[str, ...] = ()
    # Serving without keys on an address other than loopback must be asked for explicitly.
    allow_unauthenticated: bool = False
    # Origins whose web pages may call the API from a browser (CORS; vLLM's --allowed-origins,
    # ["*"] for any). Credentials (cookies) are never allowed. Empty (the default, where vLLM
    # allows any): browsers refuse cross-origin calls, so a web page the operator visits
    # cannot use a keyless local server (its answers, its training log).
    cors_allowed_origins: tuple[str, ...] = ()
    # How replies are read for tool calls (serving.tool_parsers, vLLM's --tool-call-parser):
    # hermes (Hermes, Qwen), llama3_json (Llama 3.x), mistral (Mistral, Mixtral), qwen3_coder
    # (Qwen3-Coder's XML), openai (gpt-oss's harmony), deepseek_v3 (DeepSeek V3, R1),
    # deepseek_v31 (DeepSeek V3.1), kimi_k2 (Kimi K2), gemma4 (Gemma 4), glm45 or glm47
    # (GLM-4.5 to 4.7, the layout read from the template), pythonic or llama4_pythonic
    # ([name(key=value), ...]), none (tools refused), or auto: from the chat template's
    # text (harmony's <|channel|> and <|call|>: openai; <｜tool▁calls▁begin｜>:
    # deepseek_v3 with a ```json fence, else deepseek_v31; <|tool_calls_section_begin|>:
    # kimi_k2; <|tool_call>: gemma4; <tool_call> and <function=: qwen3_coder; <arg_key>:
    # glm45; <tool_call>: hermes; [TOOL_CALLS]: mistral; func_name1(: pythonic;
    # <|python_tag|>: llama3_json; else none).
    tool_call_parser: str = "auto"
    # How a chat reply's thinking is read apart from its answer (serving.reasoning, vLLM's
    # --reasoning-parser): qwen3 or deepseek_r1 (<think> ... </think>, answered as the
    # message's reasoning), gemma4 (<|channel>thought ... <channel|>), openai_gptoss
    # (harmony's analysis channel), none (the thinking stays in the content), or auto: from
    # the chat template (harmony: openai_gptoss; </think>: qwen3; <channel|>: gemma4; else
    # none).
    reasoning_parser: str = "auto"
    # How HTTP reaches the replicas (serving.ingress): haproxy (Ray Serve's high-throughput
    # mode: HAProxy in front, each replica serving HTTP itself on its own event loop) or proxy
    # (Ray Serve's Python proxy actor, every token through it). Set when osd starts Ray.
    ingress: str = "haproxy"
    # Streamed responses: a step that comes less than this many milliseconds after a request's
    # last event waits for the next step and goes out with it (vLLM's and SGLang's
    # --stream-interval, in time rather than tokens). The first event and a choice's last go
    # at once. Every event costs the replica's event loop (beside the decode thread), the
    # network and the client: at one client on the demo target, 64 events a request took
    # 223-229 ms, 10 took 189.
    # 0: an event a step, whenever the client keeps up.
    stream_interval_ms: float = 20.0
    # All streams together send at most about this many events a second: with many streams
    # open each gathers over streams / this seconds (up to 200 ms) when that is longer than
    # the interval above (at 16 streams and 400: 40 ms). For hosts whose steps are short
    # beside many streams (a GPU's hundreds at ~10 ms a step: tens of thousands of events a
    # second on one event loop). 0 (default): no cap; on 2 CPU cores at 16 streams a cap of
    # 400 moved nothing beyond the noise (docs/benchmarks.md, 2026-12-06, thirteenth session).
    stream_events_per_s: float = 0.0

    def check_access(self) -> None:
        """Raises ConfigError when this would serve without keys beyond loopback unasked (the
        serving entry points call it before they start; a trainer reading the same file
        does not)."""
        if not (self.api_keys or self.allow_unauthenticated or is_loopback(self.host)):
            raise ConfigError(
                f"serve.host {self.host!r} is reachable from other machines and serve.api_keys "
                "is empty: set serve.api_keys (or OSD_API_KEYS), or serve.allow_unauthenticated: "
                "true to serve without keys"
            )

    def __post_init__(self) -> None:
        _require(0 < self.port < 65536, "serve.port", self.port, "in 1..65535")
        if any(not key or key != key.strip() for key in self.api_keys):
            raise ValueError("serve.api_keys must be non-empty, without surrounding spaces")

        _require(self.num_replicas >= 1, "serve.num_replicas", self.num_replicas, ">= 1")
        _require(
            self.max_ongoing_requests >= 1,
            "serve.max_ongoing_requests",
            self.max_ongoing_requests,
            ">= 1",
        )
        _require(
            self.max_tokens_limit >= 1, "serve.max_tokens_limit", self.max_tokens_limit, ">= 1"
        )
        _require(self.max_num_seqs >= 1, "serve.max_num_seqs", self.max_num_seqs, ">= 1")
        _require(
            self.max_num_batched_tokens >= 1,
            "serve.max_num_batched_tokens",
            self.max_num_batched_tokens,
            ">= 1",
        )
        _require(self.kv_slots >= 0, "serve.kv_slots", self.kv_slots, ">= 0")
        _require(self.max_model_len >= 0, "serve.max_model_len", self.max_model_len, ">= 0")
        _require(
            0.0 <= self.gpu_memory_utilization <= 1.0,
            "serve.gpu_memory_utilization",
            self.gpu_memory_utilization,
            "in [0, 1]",
        )
        _require(
            self.kv_cache_memory_bytes >= 0,
            "serve.kv_cache_memory_bytes",
            self.kv_cache_memory_bytes,
            ">= 0",
        )
        _require(self.torch_threads >= 0, "serve.torch_threads", self.torch_threads, ">= 0")
        _require(
            0.0 <= self.gil_switch_interval_ms <= 100.0,
            "serve.gil_switch_interval_ms",
            self.gil_switch_interval_ms,
            "in [0, 100]",
        )
        _require(
            self.tool_call_parser in ("auto", *TOOL_CALL_PARSERS, "none"),
            "serve.tool_call_parser",
            self.tool_call_parser,
            f"auto, {', '.join(TOOL_CALL_PARSERS)} or none",
        )
        _require(
            self.reasoning_parser in ("auto", *REASONING_PARSERS, "none"),
            "serve.reasoning_parser",
            self.reasoning_parser,
            f"auto, {', '.join(REASONING_PARSERS)} or none",
        )
        _require(
            self.ingress in ("haproxy", "proxy"), "serve.ingress", self.ingress, "haproxy or proxy"
        )
        _require(
            0.0 <= self.stream_interval_ms <= 1000.0,
            "serve.stream_interval_ms",
            self.stream_interval_ms,
            "in [0, 1000]",
        )
        _require(
            self.stream_events_per_s >= 0,
            "serve.stream_events_per_s",
            self.stream_events_per_s,
            ">= 0",
        )


@dataclass(frozen=True)
class AdapterConfig:
    """Where published adapter versions live and how replicas follow and judge them."""

    store: Literal["directory", "redis"] = "redis"
    root: str = ""  # directory store: shared folder; empty: a folder under the run directory
    reconcile_interval_s: float = 1.0
    rollback_window: int = 1024  # drafted tokens (~20 requests) per version before judging it
    rollback_margin: float = 0.05  # roll back when acceptance drops by more than this
    # Versions kept besides the current one (rollbacks need >= 1), and how long any version
    # stays after it was published; replicas' held versions are never deleted.
    keep_versions: int = 4
    gc_grace_s: float = 60.0

    def __post_init__(self) -> None:
        _require(self.keep_versions >= 1, "adapters.keep_versions", self.keep_versions, ">= 1")
        _require(self.gc_grace_s >= 0, "adapters.gc_grace_s", self.gc_grace_s, ">= 0")


@dataclass(frozen=True)
class TrainerConfig:
    """The online distillation worker."""

    loss: Literal["forward_kl", "reverse_kl", "jsd", "tvd"] = "forward_kl"
    positions: Literal["all", "rejected"] = "all"
    learning_rate: float = 1e-3
    batch_records: int = 16
    steps_per_round: int = 20
    replay_size: int = 500  # records replayed per domain (at most max_domains domains)
    holdout_fraction: float = 0.2  # share of a domain's records its judge window keeps (newest)
    publish_margin: float = 0.01
    min_records: int = 32
    group: str = "trainer"
    device: str = "auto"
    # Several devices of one machine: one process each, every step's records split over them
    # (trainer.data_parallel); empty: `device` alone.
    devices: tuple[str, ...] = ()
    # Trainer workers `osd train` starts on this machine (> 1: a pool, each with `pool` set).
    workers: int = 1
    # This trainer is one worker of a pool sharing the log through leases (trainer.pool); off:
    # the only trainer of its group.
    pool: bool = False
    lease_s: float = 10.0  # a pool worker's adapters go to others this long after it stopped
    holdout_size: int = 256  # most records a judge window keeps, per adapter and domain
    max_domains: int = 8  # domains with their own replay and hold-out windows (least recent out)
    max_domain_regression: float = 0.01  # refuse a candidate worse than this on any one domain
    min_holdout_records: int = 8  # fewest a judge window keeps; no judging with fewer; a first
    # version is trained once an adapter without one has this many fresh records too
    max_record_wait_s: float = 30.0  # start a round with < min_records once one waited this long
    consumer: str = ""  # consumer name in the group; empty: <hostname>-<pid>
    claim_idle_ms: int = 60_000  # take over entries other consumers left pending this long
    seed: int = 0  # replay sampling
    # torch intra-op threads of the trainer on a CPU; 0: chosen from the cores it may use and
    # what shares them (osd.threads).
    torch_threads: int = 0

    def __post_init__(self) -> None:
        _require(self.learning_rate > 0, "trainer.learning_rate", self.learning_rate, "> 0")
        _require(
            0 < self.holdout_fraction < 1,
            "trainer.holdout_fraction",
            self.holdout_fraction,
            "in (0, 1)",
        )
        for name in ("batch_records", "steps_per_round", "replay_size", "min_records"):
            _require(getattr(self, name) >= 1, f"trainer.{name}", getattr(self, name), ">= 1")
        _require(self.holdout_size >= 1, "trainer.holdout_size", self.holdout_size, ">= 1")
        _require(self.max_domains >= 1, "trainer.max_domains", self.max_domains, ">= 1")
        _require(
            0 <= self.max_domain_regression < 1,
            "trainer.max_domain_regression",
            self.max_domain_regression,
            "in [0, 1)",
        )
        _require(
            self.min_holdout_records >= 1,
            "trainer.min_holdout_records",
            self.min_holdout_records,
            ">= 1",
        )
        _require(
            0 <= self.publish_margin < 1, "trainer.publish_margin", self.publish_margin, "in [0, 1)"
        )
        _require(
            self.max_record_wait_s > 0, "trainer.max_record_wait_s", self.max_record_wait_s, "> 0"
        )
        _require(self.torch_threads >= 0, "trainer.torch_threads", self.torch_threads, ">= 0")
        _require(self.claim_idle_ms >= 0, "trainer.claim_idle_ms", self.claim_idle_ms, ">= 0")
        _require(bool(self.group), "trainer.group", self.group, "a non-empty consumer group")
        _require(self.workers >= 1, "trainer.workers", self.workers, ">= 1")
        _require(self.lease_s > 0, "trainer.lease_s", self.lease_s, "> 0")
        kinds = {d.split(":")[0] for d in self.devices}
        _require(
            kinds <= {"cpu", "cuda"} and len(kinds) <= 1 and all(self.devices),
            "trainer.devices",
            list(self.devices),
            "devices of one kind, cpu or cuda[:i]",
        )


@dataclass(frozen=True)
class RoutingConfig:
    """Content routing of requests that name no ``domain`` and no ``draft`` (docs/trainer.md,
    "Content routing"): the trainer fits a routing model on logged records and gives free domain
    adapters to new topics of unlabeled traffic; replicas route by the published model."""

    enabled: bool = True
    # Replica: the bandit chooses when the model's choice is less likely than this. 0: always
    # follow the model, as the trainer judged it (its argmax).
    min_confidence: float = 0.0
    fit_every: int = 8  # trainer: a candidate router each this many new records
    window: int = 256  # newest records of each domain the router is fit and judged on
    publish_margin: float = 0.002  # routed acceptance a candidate must add on held-out records
    discover: bool = True  # open a free domain adapter for a new topic of unlabeled traffic
    topic_similarity: float = 0.25  # cosine of a prompt to a topic's centroid to belong to it
    novelty_margin: float = 0.15  # below the median acceptance by this much: served poorly
    # Replica: share of unlabeled requests a new routing model's predecessor still routes, so the
    # two are compared on the same traffic before the new one is kept or rolled back.
    trial_share: float = 0.2

    def __post_init__(self) -> None:
        _require(
            0 <= self.min_confidence <= 1,
            "routing.min_confidence",
            self.min_confidence,
            "in [0, 1]",
        )
        _require(self.fit_every >= 1, "routing.fit_every", self.fit_every, ">= 1")
        _require(self.window >= 16, "routing.window", self.window, ">= 16")
        _require(
            0 <= self.publish_margin < 1, "routing.publish_margin", self.publish_margin, "in [0, 1)"
        )
        _require(
            0 < self.topic_similarity < 1,
            "routing.topic_similarity",
            self.topic_similarity,
            "in (0, 1)",
        )
        _require(
            0 <= self.novelty_margin < 1, "routing.novelty_margin", self.novelty_margin, "in [0, 1)"
        )
        _require(0 <= self.trial_share < 1, "routing.trial_share", self.trial_share, "in [0, 1)")


@dataclass(frozen=True)
class WandbConfig:
    """Weights & Biases: offline by default (``wandb sync`` later); online with a key."""

    mode: Literal["offline", "online", "disabled"] = "offline"
    project: str = "osd"
    dir: str = ""


@dataclass(frozen=True)
class OSDConfig:
    """Everything one deployment of osd needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    log: LogConfig = field(default_factory=LogConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    adapters: AdapterConfig = field(default_factory=AdapterConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    run_dir: str = "runs/latest"


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only (localhost, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def _require(ok: bool, name: str, value: Any, expected: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {expected}, got {value!r}")


# serve.tool_call_parser's formats (serving.tool_parsers reads and writes them).
TOOL_CALL_PARSERS = (
    "hermes",
    "llama3_json",
    "mistral",
    "qwen3_coder",
    "openai",
    "deepseek_v3",
    "deepseek_v31",
    "kimi_k2",
    "gemma4",
    "glm45",
    "glm47",
    "pythonic",
    "llama4_pythonic",
)
# serve.reasoning_parser's readers of thinking (serving.reasoning, serving.harmony).
REASONING_PARSERS = ("qwen3", "deepseek_r1", "gemma4", "openai_gptoss")
BUILTIN_CONFIGS = ("demo",)  # shipped in the package: osd/configs/<name>.yaml


def config_path(path: str | Path) -> Path:
    """The file a ``--config`` value names: a path (relative to the current directory), or the
    name of a config shipped with the package (``demo``: the embedded local default)."""
    given = Path(path)
    if given.is_file():
        return given
    if str(path) in BUILTIN_CONFIGS:
        import importlib.resources

        return Path(str(importlib.resources.files("osd") / "configs" / f"{path}.yaml"))
    raise ConfigError(
        f"{path}: no such config file (looked in {Path.cwd()}; built-in configs: "
        f"{', '.join(BUILTIN_CONFIGS)})"
    )


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> OSDConfig:
    """Loads a YAML config (or the defaults) and applies ``a.b=value`` overrides.

    ``path`` is a file (relative to the current directory) or a built-in config's name
    (:func:`config_path`). ``${VAR}`` in the file is replaced from the environment (unset
    variables stay as written); ``OSD_API_KEYS`` fills ``serve.api_keys`` when it is empty.

    Raises:
        ConfigError (a ValueError): a missing or unreadable file, bad YAML, unknown keys,
            malformed overrides or values of the wrong type; the message names the file.
    """
    file = None if path is None else config_path(path)
    try:
        return _load(file, overrides)
    except ConfigError:
        raise
    except (OSError, ValueError, yaml.YAMLError) as e:
        problem = " ".join(str(e).split())  # one line (YAML's errors span several)
        raise ConfigError(problem if path is None else f"{path}: {problem}") from e


def _load(path: Path | None, overrides: list[str] | None) -> OSDConfig:
    data: dict[str, Any] = {}
    if path is not None:
        # ${VAR} in the file is taken from the environment (e.g. a Redis password).
        loaded = yaml.safe_load(os.path.expandvars(path.read_text())) or {}
        if not isinstance(loaded, dict):
            raise ValueError(
                f"{path}: the top level must be a mapping, got {type(loaded).__name__}"
            )
        data = loaded
    for override in overrides or []:
        key, sep, raw = override.partition("=")
        if not sep or not key:
            raise ValueError(f"override must look like a.b=value, got {override!r}")
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {override!r}: {part} is not a section")
        node[leaf] = yaml.safe_load(raw) if raw else ""
    env_keys = [k.strip() for k in os.environ.get("OSD_API_KEYS", "").split(",") if k.strip()]
    serve = data.setdefault("serve", {})
    if env_keys and isinstance(serve, dict) and not serve.get("api_keys"):
        serve["api_keys"] = env_keys
    return config_from_dict(OSDConfig, data)


def _env_flag(name: str, *, default: bool) -> bool:
    """A default taken from the environment: ``0``/``false``/``no``/``off`` or
    ``1``/``true``/``yes``/``on`` (any case); unset or empty: ``default``."""
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}={os.environ[name]!r}: expected 1 or 0 (true or false)")


def resolve_device(device: str) -> str:
    """``auto`` becomes ``cuda`` where a GPU is present, else ``cpu``."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(dtype: str, device: str) -> str:
    """``auto`` becomes ``bfloat16`` on CUDA and ``float32`` elsewhere."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device.startswith("cuda") else "float32"
