"""Structured outputs: the request fields that constrain a response (OpenAI's response_format,
vLLM's structured_outputs and its older guided_* fields) as one GrammarSpec, checked (compiled)
off the event loop before the request is admitted."""
import asyncio
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pdserve.engine.grammar import GrammarSpec
from pdserve.engine.interface import grammars
from pdserve.errors import RequestError


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs: exactly one of these."""
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None


class StructuredFields(BaseModel):
    """The constraining fields completions and chat share."""
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None

    def grammar_spec(self) -> GrammarSpec | None:
        """The one constraint this request asks for (None: free text); RequestError if it asks for two."""
        specs = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            specs.append(GrammarSpec("json_object", param="response_format"))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise RequestError("response_format of type json_schema needs json_schema.schema",
                                   param="response_format")
            specs.append(json_spec(rf.json_schema.schema_, "response_format"))
        so = self.structured_outputs
        if so is not None:
            given = [(k, v) for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                        ("grammar", so.grammar), ("json_object", so.json_object or None))
                     if v is not None]
            if len(given) != 1:
                raise RequestError("structured_outputs needs exactly one of json, regex, choice, grammar, "
                                   f"json_object; got {len(given)}", param="structured_outputs")
            specs.append(_spec(*given[0], "structured_outputs"))
        for kind in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{kind}")
            if value is not None:
                specs.append(_spec(kind, value, f"guided_{kind}"))
        if len(specs) > 1:
            raise RequestError(f"at most one of response_format, structured_outputs and guided_* may constrain "
                               f"the output; got {', '.join(s.param for s in specs)}", param=specs[1].param)
        return specs[0] if specs else None


def json_spec(schema, param: str) -> GrammarSpec:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise RequestError(f"{param}: the schema is not valid JSON ({e})", param=param) from None
    if not isinstance(schema, (dict, bool)):
        raise RequestError(f"{param}: a JSON schema is an object", param=param)
    # not sorted: properties are generated in the schema's order
    return GrammarSpec("json", json.dumps(schema), param)


def _spec(kind: str, value, param: str) -> GrammarSpec:
    if kind == "json":
        return json_spec(value, param)
    if kind == "json_object":
        return GrammarSpec("json_object", param=param)
    if kind == "choice":
        if any(not c for c in value):
            raise RequestError(f"{param}: choices must be non-empty strings", param=param)
        return GrammarSpec("choice", json.dumps(value), param)
    if not value:
        raise RequestError(f"{param} must not be empty", param=param)
    return GrammarSpec(kind, value, param)


async def check_grammar(engine, spec: GrammarSpec | None) -> None:
    """Compile the spec (cached) in a worker thread: a big schema must not stall the event loop,
    and a bad one is a 400 naming its field before anything is admitted."""
    if spec is None:
        return
    compiler = grammars(engine)
    if compiler is None:
        raise RequestError("constrained decoding is not supported by this backend", param=spec.param)
    await asyncio.to_thread(compiler.check, spec)
