"""OpenAI-compatible request and response shapes, and OpenAI-style errors.

Requests take the usual OpenAI fields plus osd's own: ``draft`` (adapter or domain), ``domain``
(a route label), ``spec`` (method, k, K) and ``log`` (false opts the request out of logging).
Validation failures become :class:`APIError` with a 4xx status, never a 500.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StrictBool,
    StrictInt,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from osd.buffer.record import MAX_ID_BYTES
from osd.config import SpecConfig
from osd.decode.limits import HTTP_MAX_DRAFTS, HTTP_MAX_SPEC_TOKENS, MAX_LOGPROBS
from osd.decode.methods import Method, ProposerChoice
from osd.decode.options import OPTION_NAMES, RequestOptions
from osd.decode.sampling import GREEDY_BELOW
from serving.openai_fields import FieldRefused, check_fields, check_messages
from serving.structured_output import ResponseFormat, StructuredOutputs
from serving.tools import MAX_TOOLS, FunctionTool, MessageToolCall, ToolChoice

__all__ = [
    "APIError",
    "ChatMessage",
    "ChatRequest",
    "CompletionRequest",
    "SpecOptions",
    "error_body",
    "parse_request",
]


class APIError(Exception):
    """An error answered to the client with an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (
            status,
            message,
            param,
            code,
            kind,
        )

    def body(self) -> dict[str, Any]:
        return error_body(self.message, kind=self.kind, param=self.param, code=self.code)


def error_body(
    message: str,
    *,
    kind: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    """The OpenAI error envelope."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


MAX_LOGIT_BIAS = 1024  # entries of one request's logit_bias
MAX_CHOICES = 16  # n: choices of one request, each a row of the batch


# The deepest a request's JSON may nest (a JSON schema of response_format or a tool's
# parameters nests a level per object; Python's parser itself gives up near a thousand).
MAX_JSON_DEPTH = 64


def _check_text(data: Any) -> None:
    """Refuses (400, naming the path) a body nested deeper than :data:`MAX_JSON_DEPTH` or with
    a string no tokenizer can encode (JSON may escape lone surrogates, ``"\\ud800"``),
    wherever it is: checks of the prompt and message fields alone let a tool's description
    reach the tokenizer and fail there (500)."""
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise APIError(400, f"JSON body nested deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(value, dict):
            items: Any = value.items()
        elif isinstance(value, list):
            items = enumerate(value)
        else:
            items = ()
        for key, item in items:
            name = key if isinstance(key, str) and _encodable(key) else f"[{key!a}]"
            where = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{name}".lstrip(".")
            if not _encodable(key) or (isinstance(item, str) and not _encodable(item)):
                raise APIError(400, f"{where}: text is not valid unicode", param=where)
            stack.append((item, where, depth + 1))


def _encodable(text: str | int) -> bool:
    try:
        str(text).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class SpecOptions(BaseModel):
    """osd's speculative decoding options for one request."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    method: Method | None = None
    k: Annotated[int, Field(ge=1, le=HTTP_MAX_SPEC_TOKENS)] | Literal["auto"] | None = None
    K: int | None = Field(default=None, ge=1, le=HTTP_MAX_DRAFTS)
    # Who drafts: "auto" (the controller), "draft" (the draft model), "suffix", "ngram".
    proposer: ProposerChoice | None = None


class StreamOptions(BaseModel):
    """A misspelt option is refused, as a misspelt field is (``include_usages`` ignored would
    leave a client without the usage it asked for)."""

    model_config = ConfigDict(extra="forbid")

    # Left out of a stream_options that is sent: on, as vLLM has it (OpenAI's clients send
    # it whenever they want it); null: off.
    include_usage: bool | None = True
    # vLLM's: every chunk carries the usage so far.
    continuous_usage_stats: bool | None = False
    # OpenAI's padding of stream events against size side channels: osd pads none (what
    # false asks for); true is accepted as OpenAI's default, without the padding.
    include_obfuscation: bool | None = None


class _Common(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    # 0 or -1 (vLLM's spelling, which clients moving from it send) keep every token; the record
    # stores it as int32.
    top_k: int = Field(default=0, ge=-1, le=2**31 - 1)
    # Applied alike to draft and target (osd.decode.sampling), so every method stays exact.
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=100.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    # vLLM's: token ids that end generation besides the end-of-sequence token.
    stop_token_ids: list[Annotated[int, Field(ge=0, le=2**31 - 1)]] = Field(
        default_factory=list, max_length=64
    )
    # vLLM's: the end-of-sequence token does not end generation (stop strings and
    # stop_token_ids still do); what benchmarks send to generate exactly max_tokens.
    ignore_eos: StrictBool = False
    # vLLM's: false writes the tokenizer's special tokens in the text (the tokens that ended
    # generation never); with tools, a parser whose marker is a special token turns it off.
    skip_special_tokens: StrictBool = True
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)  # int64 in the record
    # Choices, each its own sample with a seed derived from (seed, index) (osd.decode.choices).
    n: StrictInt = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    draft: str | None = Field(default=None, max_length=128)
    domain: str | None = Field(default=None, max_length=128)
    spec: SpecOptions | None = None
    log: bool = True
    # Structured output (serving.structured_output): OpenAI's, vLLM's, vLLM's older spelling.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, max_length=256)
    guided_grammar: str | None = None

    @field_validator("temperature")
    @classmethod
    def _tiny_temperature_is_greedy(cls, temperature: float) -> float:
        # As the engine does (osd.decode.sampling.SamplingParams): responses and records say 0.
        return 0.0 if temperature < GREEDY_BELOW else temperature

    @field_validator("top_k")
    @classmethod
    def _all_tokens_is_zero(cls, top_k: int) -> int:
        return max(top_k, 0)

    @field_validator("logit_bias")
    @classmethod
    def _bias_by_token_id(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        # OpenAI's shape: token ids as JSON object keys (strings), biases in [-100, 100].
        for token, value in (bias or {}).items():
            if not token.isdigit() or len(token) > 10:
                raise ValueError(f"keys must be token ids, got {token!r}")
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"values must be in [-100, 100], got {value!r} for {token}")
        return bias

    @property
    def token_bias(self) -> dict[int, float]:
        return {int(token): value for token, value in (self.logit_bias or {}).items()}

    @field_validator("domain")
    @classmethod
    def _domain_is_a_label(cls, domain: str | None) -> str | None:
        # The domain goes into the request's record, which holds short printable labels only.
        if domain is not None and (not domain.isprintable() or len(domain.encode()) > MAX_ID_BYTES):
            raise ValueError(f"domain must be a printable label of at most {MAX_ID_BYTES} bytes")
        return domain

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > 4 or any(len(s) > 64 for s in stops):
            raise ValueError("at most 4 stop sequences of at most 64 characters")
        return stop

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @field_validator("stream_options")
    @classmethod
    def _only_when_streamed(
        cls, options: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        if options is not None and not info.data.get("stream"):
            raise ValueError("stream_options needs stream: true")
        return options

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Every chunk of the stream carries the usage so far (vLLM's)."""
        options = self.stream_options  # vLLM's: only with the usage asked for at all
        return bool(options and options.include_usage and options.continuous_usage_stats)

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Alternatives per prompt token to report (completions' echo); None: none."""
        return None

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives per token to report; None: no logprobs."""
        return None

    @property
    def asked_tokens(self) -> int | None:
        """The budget the request names: ``max_completion_tokens``, else ``max_tokens`` (0:
        echo's prompt alone); None: neither."""
        asked = (self.max_completion_tokens, self.max_tokens)
        return next((m for m in asked if m is not None), None)

    def requested_tokens(self, limit: int) -> int:
        """The completion's budget: the one it names, else OpenAI's default: 16 for a
        completion, for a chat what the context leaves after the prompt, up to ``limit``."""
        asked = self.asked_tokens
        if asked is not None:
            return asked
        return limit if isinstance(self, ChatRequest) else 16

    def options(self, defaults: SpecConfig, limit: int, **replica: Any) -> RequestOptions:
        """The request's options (:mod:`osd.decode.options`), built here once: fields that
        mean the same in both are taken by name; the rest are spelled out below. ``limit``:
        the replica's most tokens a request (a chat's default budget). ``replica``: what only
        the replica knows (the compiled grammar, whether it logs, the tokens that end
        generation); the router picks the adapter later."""
        spec = self.spec or SpecOptions()
        same = {name: getattr(self, name) for name in _SAME_AS_OPTIONS}
        return RequestOptions.of(
            **same,
            **replica,
            max_tokens=self.requested_tokens(limit),
            # A budget the client named is refused where it does not fit (OpenAI's, vLLM's);
            # a default one is what fits.
            fit_context=self.asked_tokens is None,
            logit_bias=self.token_bias,
            stop=self.stop_list,
            method=spec.method or defaults.method,
            num_spec_tokens=spec.k or defaults.num_spec_tokens,
            num_drafts=spec.K or defaults.num_drafts,
            proposer=spec.proposer or defaults.proposer,
            route=self.domain or "",
            logprobs=self.num_logprobs,
            prompt_logprobs=self.num_prompt_logprobs,
        )


# Request fields whose name and meaning are the options' (sampling fields such as top_p, the
# seed): taken over by name. The others differ in shape or meaning (chat's logprobs is a flag,
# stop may be one string, the logit bias is keyed by strings, stop_token_ids gain the end of
# sequence in the replica) and are converted in _Common.options.
_DIFFERENT = frozenset(
    {
        "max_tokens",
        "logit_bias",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "logprobs",
        "prompt_logprobs",
        "log",
    }
)
_SAME_AS_OPTIONS = tuple(sorted((OPTION_NAMES & set(_Common.model_fields)) - _DIFFERENT))


class CompletionRequest(_Common):
    # One prompt (text or token ids), or several (OpenAI's batch: texts or lists of ids), each
    # completed on its own: choice i * n + j is prompt i's j-th (:attr:`prompts`).
    prompt: str | list[int] | list[str] | list[list[int]]
    # Chat's tool fields: refused here by name rather than ignored.
    tools: None = None
    tool_choice: None = None

    @field_validator("tools", "tool_choice", mode="before")
    @classmethod
    def _no_tools(cls, value: Any) -> None:
        if value not in (None, [], "none", "auto"):
            raise ValueError("is a chat field; completions do not call tools")
        return None

    # OpenAI's legacy completions: the sampled token's logprob and this many alternatives.
    # 0..20: vLLM's bound (its max_logprobs), beyond OpenAI's 5, so a vLLM client's 10 works.
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    top_logprobs: None = None  # chat's field; refused here rather than ignored
    # The prompt before the completion, and with logprobs its tokens' logprobs too.
    echo: StrictBool = False
    # 0 with echo: the prompt alone, scored (OpenAI's and vLLM's prompt scoring).
    max_tokens: int | None = Field(default=None, ge=0)

    @field_validator("logprobs", mode="before")
    @classmethod
    def _false_is_off(cls, logprobs: Any) -> Any:
        return None if logprobs is False else logprobs  # the no-op clients send

    @field_validator("top_logprobs", mode="before")
    @classmethod
    def _no_top_logprobs(cls, top_logprobs: Any) -> None:
        if top_logprobs not in (None, 0):
            raise ValueError("is a chat field; completions take logprobs: n (0..20)")
        return None

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives per token to report; None: no logprobs."""
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Alternatives per prompt token to report (echo with logprobs); None: none."""
        return self.logprobs if self.echo else None

    @model_validator(mode="after")
    def _no_tokens_needs_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            # An APIError passes through pydantic, so the 400 names the field.
            raise APIError(
                400, "max_tokens: 0 asks for no completion; it needs echo: true", param="max_tokens"
            )
        return self

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_kind_of_prompt(cls, prompt: Any) -> Any:
        """A list is of token ids, of texts or of token-id lists, not a mix (named as one
        error rather than one per arm of the union)."""
        if isinstance(prompt, list) and prompt:
            kinds = {type(item) for item in prompt}
            if len(kinds) > 1:
                raise ValueError("a prompt list holds one kind: token ids, texts or id lists")
        return prompt

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, prompt: Any) -> Any:
        """A list of one prompt is that prompt; every prompt must hold something."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if not all(prompt):
                raise ValueError("every prompt of the list must not be empty")
            if len(prompt) == 1:
                prompt = prompt[0]
        if not prompt:
            raise ValueError("prompt must not be empty")
        return prompt

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request (one, or the list's)."""
        prompt: Any = self.prompt
        if isinstance(prompt, list) and isinstance(prompt[0], str | list):
            return list(prompt)
        return [prompt]

    def each_prompt(self) -> list[CompletionRequest]:
        """The request once for each of its prompts."""
        return [self.model_copy(update={"prompt": prompt}) for prompt in self.prompts]


class ChatMessage(BaseModel):
    """One chat message as :func:`serving.openai_fields.check_messages` leaves it (what osd
    does not do is refused there, by its path): text content, the harmless ``name``, an
    assistant's earlier ``tool_calls`` and a tool's ``tool_call_id``."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str
    # A participant's name: given to the chat template only when sent.
    name: str | None = Field(default=None, max_length=256)
    tool_calls: list[MessageToolCall] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_call_id: str | None = Field(default=None, max_length=256)
    # An assistant's earlier thinking, under vLLM's name or DeepSeek's; the template gets both
    # (and gpt-oss's "thinking").
    reasoning: str | None = None
    reasoning_content: str | None = None

    @model_serializer(mode="wrap")
    def _only_what_was_sent(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        message: dict[str, Any] = handler(self)
        thinking = message.get("reasoning_content") or message.get("reasoning")
        if thinking is not None:  # (gpt-oss's template reads it as "thinking")
            message["reasoning"] = message["reasoning_content"] = message["thinking"] = thinking
        for key in ("name", "tool_calls", "tool_call_id", "reasoning", "reasoning_content"):
            if message.get(key) is None:
                message.pop(key, None)
        return message

    @model_validator(mode="after")
    def _tool_fields_by_role(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls belong to assistant messages")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self


# apply_chat_template's own arguments and the variables the server gives every template.
_TEMPLATE_ARGUMENTS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1, max_length=256)
    # Tool calling (serving.tools).
    tools: list[FunctionTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's: false leaves a reasoning model's thinking out of the answer (serving.reasoning).
    include_reasoning: StrictBool = True
    # vLLM's: more variables for the chat template (Qwen3's enable_thinking).
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's: a reasoning model's effort, the chat template's reasoning_effort (gpt-oss's).
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: None = None  # completions' field (vLLM's chat echo is not served); refused here

    @field_validator("echo", mode="before")
    @classmethod
    def _no_echo(cls, echo: Any) -> None:
        if echo not in (None, False):
            raise ValueError("is a completions field; chat does not echo its messages")
        return None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        for key in kwargs or {}:
            if not key.isidentifier():
                raise ValueError(f"{key[:40]!r} is not a template variable's name")
            if key in _TEMPLATE_ARGUMENTS:
                raise ValueError(f"{key} is set by the server, not by chat_template_kwargs")
        return kwargs

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        # As OpenAI: alternatives without the tokens' own logprobs are an error.
        if top and not info.data.get("logprobs"):
            raise ValueError("needs logprobs: true")
        return top

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives per token to report; None: no logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None


def parse_request(
    kind: Literal["completion", "chat"], data: Any
) -> CompletionRequest | ChatRequest:
    """Validates a decoded JSON body; raises :class:`APIError` (400) naming the bad field."""
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    _check_text(data)
    model = CompletionRequest if kind == "completion" else ChatRequest
    try:  # what osd does not implement is refused by name, never silently ignored
        data = check_fields(data, model.model_fields)
        if kind == "chat" and "messages" in data:  # and inside the messages, by path
            data = {**data, "messages": check_messages(data.get("messages"))}
    except FieldRefused as exc:
        raise APIError(400, str(exc), param=exc.param, code=exc.code) from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        # messages[1].content, as check_messages names paths (pydantic: messages.1.content);
        # a union's arm tags its errors ("constrained-int", "literal['auto']"): no field names
        path = [p for p in first["loc"] if isinstance(p, int) or str(p).isidentifier()]
        param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)[1:]
        raise APIError(400, f"{param}: {first['msg']}", param=param) from None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())
