"""Structured output over HTTP: which request field asks for which grammar (osd.decode.grammar).

Three spellings, one per request at most:

* OpenAI's ``response_format``: ``{"type": "text"}`` (free text, the default),
  ``{"type": "json_object"}`` (any JSON object) or ``{"type": "json_schema", "json_schema":
  {"name": ..., "schema": {...}, "strict": ...}}`` (a JSON value following the schema; without a
  ``schema``, any JSON object). Served on both endpoints, as vLLM does.
* vLLM's ``structured_outputs``: exactly one of ``json`` (a schema), ``regex``, ``choice`` (a
  list of strings), ``grammar`` (a Lark grammar, llguidance's dialect, or llama.cpp's GBNF as
  vLLM's xgrammar backend takes it) or ``json_object: true``.
* vLLM's older ``guided_json``, ``guided_regex``, ``guided_choice`` and ``guided_grammar``, the
  same four.

The output is generated compactly (no whitespace between JSON tokens) and ends with the end-of-
sequence token once the grammar is complete, so ``finish_reason`` is ``stop``; a ``length``
finish means the budget ran out first and the text is an unfinished prefix of a valid output.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from osd.errors import ParamError

__all__ = ["GrammarAsk", "JSONSchemaFormat", "ResponseFormat", "StructuredOutputs", "grammar_ask"]

GrammarAsk = tuple[str, str, Any]  # (request field, osd.decode.grammar kind, spec)


class JSONSchemaFormat(BaseModel):
    """OpenAI's ``response_format.json_schema``."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # osd always follows the schema exactly


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is given with, and only with, type "json_schema"')
        return self


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: exactly one constraint."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(default=None, max_length=256)
    grammar: str | None = None
    json_object: bool | None = None
    # vLLM's: JSON without optional whitespace, which osd's JSON never has (true is its way;
    # false asks for whitespace it does not write).
    disable_any_whitespace: Literal[True] | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [name for name, value in self._asks() if value not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "give exactly one of json, regex, choice, grammar or json_object: true"
                + (f" (got {', '.join(given)})" if given else "")
            )
        return self

    def _asks(self) -> list[tuple[str, Any]]:
        return [
            ("json", self.json_),
            ("regex", self.regex),
            ("choice", self.choice),
            ("grammar", self.grammar),
            ("json_object", self.json_object),
        ]

    def ask(self) -> GrammarAsk:
        name, value = next((n, v) for n, v in self._asks() if v not in (None, False))
        kind = {"json": "json_schema", "grammar": "lark"}.get(name, name)
        return (f"structured_outputs.{name}", kind, None if kind == "json_object" else value)


# vLLM's older fields: (field, osd.decode.grammar kind)
GUIDED_FIELDS: tuple[tuple[str, str], ...] = (
    ("guided_json", "json_schema"),
    ("guided_regex", "regex"),
    ("guided_choice", "choice"),
    ("guided_grammar", "lark"),
)


def grammar_ask(request: Any) -> GrammarAsk | None:
    """The grammar a validated request asks for, and the field that asked; None: free text.

    Raises:
        ParamError: more than one field asks (the message names them; ``param``: the second).
    """
    asks: list[GrammarAsk] = []
    response_format: ResponseFormat | None = request.response_format
    if response_format is not None and response_format.type != "text":
        schema = response_format.json_schema and response_format.json_schema.schema_
        if schema is not None:
            asks.append(("response_format.json_schema.schema", "json_schema", schema))
        else:
            asks.append(("response_format", "json_object", None))
    if request.structured_outputs is not None:
        asks.append(request.structured_outputs.ask())
    for name, kind in GUIDED_FIELDS:
        value = getattr(request, name)
        if value is not None:
            asks.append((name, kind, value))
    if len(asks) > 1:
        raise ParamError(
            asks[1][0].partition(".")[0],
            "ask for one structured output at most, got "
            + ", ".join(field for field, _, _ in asks),
        )
    return asks[0] if asks else None
