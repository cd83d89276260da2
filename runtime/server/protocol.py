"""The OpenAI-compatible wire format: request schemas, their validation, response and chunk bodies.

1. `parse_body(raw, schema)` turns request bytes into a validated schema object or raises
   `RequestError` (HTTP 400, OpenAI error shape) naming the field: invalid JSON, a missing field,
   a wrong type, a value out of range. Schemas are strict: "16" is not a number, 1.5 is not an
   integer, true is not a number. Fields this server does not know are ignored, as OpenAI clients
   send many; fields it knows but cannot honour (suffix, best_of other than n) are refused.
2. The app resolves the prompt to token ids and checks it against the model (vocabulary, context
   length, max_tokens limit), raising `RequestError` from here too (`context_length_error`, ...).
3. `completion_choice` / `completion_body` / `completion_chunk` and `chat_choice` / `chat_body` /
   `chat_chunk` build the response objects: one choice per (prompt, n) pair, index
   prompt * n + i, as OpenAI numbers them. Each choice also carries `token_ids` (an hgc
   extension): the generated ids, so a client without the tokenizer, or a test, sees exactly
   what the engine produced. Log-probabilities come formatted (runtime/server/logprobs.py).

Error body: {"error": {"message", "type", "param", "code"}}, as OpenAI sends it.

It does not talk to the engine or the network (app.py does).
"""

from __future__ import annotations

import json
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

__all__ = ["RequestError", "error_body", "parse_body", "CompletionRequest", "ChatCompletionRequest", "ChatMessage",
           "StreamOptions", "JsonSchemaFormat", "ResponseFormat", "completion_choice", "completion_body",
           "completion_chunk", "chat_choice", "chat_body", "chat_chunk", "usage_body", "usage_chunk", "models_body",
           "now", "MAX_STOP_STRINGS", "MAX_LOGPROBS", "MAX_N"]

MAX_STOP_STRINGS = 4  # OpenAI's limit; each one is searched in the text after every token
MAX_LOGPROBS = 20  # alternatives per token: OpenAI chat's top_logprobs limit (and vLLM's default)
MAX_N = 128  # choices per prompt: OpenAI's limit


class RequestError(Exception):
    """A request the server refuses: its HTTP status and the OpenAI error fields."""

    def __init__(self, message: str, *, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.headers = headers  # e.g. Retry-After on a 503

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# -- requests -------------------------------------------------------------------------------------


class _Strict(BaseModel):
    # strict: no "16" -> 16 or true -> 1 coercion; extra fields ignored (clients send many).
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    """response_format.json_schema, OpenAI's fields: the output follows `schema`, a JSON schema
    object that xgrammar compiles (runtime/engine/grammar.py); one it cannot is refused with its reason."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)

    name: str | None = Field(default=None, max_length=64)
    description: str | None = None
    # "schema" is BaseModel's own attribute name: the field is schema_, read and written as "schema"
    schema_: dict = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's response_format: "text" (no constraint), "json_object" (any JSON object) or
    "json_schema" with json_schema = {"name", "schema", "strict", "description"}; the output then
    follows the schema (runtime/engine/grammar.py). Checked here for shape; the schema itself is
    xgrammar's to compile."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def constrains(self) -> bool:
        return self.type != "text"

    def check(self) -> None:
        if self.type == "json_schema" and self.json_schema is None:
            raise RequestError("response_format of type json_schema needs json_schema.schema, a JSON schema object",
                               param="response_format.json_schema.schema")
        if self.type != "json_schema" and self.json_schema is not None:
            raise RequestError(f"response_format.json_schema is only for type json_schema (got type {self.type!r})",
                               param="response_format.json_schema")

    def to_json(self) -> dict:
        spec = {} if self.json_schema is None else {
            "json_schema": self.json_schema.model_dump(by_alias=True, exclude_none=True)}
        return {"type": self.type, **spec}


class _SamplingFields(_Strict):
    """Fields both endpoints share."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)  # OpenAI's default and range
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # 0 or -1: off (vLLM writes -1)
    seed: int | None = Field(default=None, ge=0, lt=2 ** 63)
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)  # OpenAI's range
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)  # vLLM's extension; 1: off
    logit_bias: dict[int, float] | None = None  # token id -> bias in [-100, 100]
    response_format: ResponseFormat | None = None  # structured output (json_object / json_schema)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value):
        # OpenAI takes one string or a list of up to four.
        if value is None:
            return None
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise ValueError("must be a string or a list of strings")
        if len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(s == "" for s in value):
            raise ValueError("a stop string is empty")
        return value

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _stop_ids(cls, value):
        if value is not None and (not isinstance(value, list) or not all(_is_int(t) and t >= 0 for t in value)):
            raise ValueError("must be a list of non-negative token ids")
        return value

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias(cls, value):
        # JSON object keys are strings: {"50256": -100}. Strict mode would refuse them as int keys.
        if value is None:
            return None
        if not isinstance(value, dict):
            raise ValueError("must be an object mapping token ids to biases")
        out = {}
        for key, bias in value.items():
            if not (isinstance(key, str) and key.strip().isdigit()):
                raise ValueError(f"key {key!r} is not a token id")
            if not (isinstance(bias, (int, float)) and not isinstance(bias, bool)) or not -100 <= bias <= 100:
                raise ValueError(f"bias of token {key} must be a number in [-100, 100] (got {bias!r})")
            out[int(key)] = float(bias)
        return out

    def refuse_unsupported(self) -> None:
        """Fields the schema knows so that a request asking for them is refused rather than ignored."""
        if self.response_format is not None and self.response_format.constrains():
            self.response_format.check()
            if self.ignore_eos:
                raise RequestError("ignore_eos cannot be combined with response_format: a structured output ends "
                                   "with the end-of-sequence token once its JSON is complete", param="ignore_eos")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. `prompt`: text, token ids, or a list of either (several prompts).

    After validation `prompt` is always a list of prompts, each a string or a list of token ids.
    `logprobs` (an integer, the legacy API's) asks for each token's log-probability and that many
    alternatives; with `echo` the prompt's tokens are scored too, and `max_tokens: 0` then scores
    the prompt without generating."""

    prompt: list[str | list[int]]
    max_tokens: int | None = Field(default=None, ge=0)  # 0: only with echo
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, value):
        if isinstance(value, str) or (isinstance(value, list) and value and all(_is_int(t) for t in value)):
            return [value]  # one prompt
        if isinstance(value, list) and value and all(isinstance(p, str) for p in value):
            return value
        if isinstance(value, list) and value and all(isinstance(p, list) and p and all(_is_int(t) for t in p)
                                                     for p in value):
            return value
        raise ValueError("must be a string, a list of token ids (integers), or a non-empty list of either, "
                         "each prompt non-empty")

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.suffix:
            raise RequestError("suffix is not supported by this server", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise RequestError("best_of is not supported by this server (leave it out, or equal to n)",
                               param="best_of")
        if self.max_tokens == 0 and not self.echo:
            raise RequestError("max_tokens must be at least 1 (0 only with echo, to score the prompt)",
                               param="max_tokens")


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | None = None
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, value):
        # OpenAI content parts: [{"type": "text", "text": ...}, ...]; only text parts are served here.
        if isinstance(value, list):
            texts = []
            for part in value:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError("only text content parts ({\"type\": \"text\", \"text\": ...}) are supported")
                texts.append(part["text"])
            return "".join(texts)
        return value

    def template_dict(self) -> dict:
        # "developer" is OpenAI's newer name for the system role; templates know "system".
        return {"role": "system" if self.role == "developer" else self.role, "content": self.content or ""}


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions. max_completion_tokens is OpenAI's newer name for max_tokens."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    add_generation_prompt: bool = True
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # Tool calling is not served: known here so that a request asking for it is refused, never
    # answered with plain text as if the tools had been seen (also the legacy functions fields).
    tools: list | None = None
    tool_choice: str | dict | None = None
    functions: list | None = None
    function_call: str | dict | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        for field in ("tools", "functions"):
            if getattr(self, field):
                raise RequestError(f"{field} are not supported by this server (no tool calling): leave {field} out",
                                   param=field, code="tools_unsupported")
        for field in ("tool_choice", "function_call"):
            if getattr(self, field) not in (None, "none"):
                raise RequestError(f"{field} is not supported by this server (no tool calling): leave it out or "
                                   f"send \"none\"", param=field, code="tools_unsupported")

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def _param(loc: tuple) -> str:
    return ".".join(str(part) for part in loc if not str(part).startswith(("function-", "union[")))


def parse_body(raw: bytes, schema: type[_Strict]):
    """Request bytes -> a validated `schema` instance, or RequestError (400) naming the field."""
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RequestError(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise RequestError("the request body must be a JSON object", code="invalid_json")
    try:
        return schema.model_validate(obj)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        param = _param(first["loc"]) or None
        message = first["msg"].removeprefix("Value error, ")
        if first["type"] == "missing":
            message = f"missing required field '{param}'"
        elif param:
            got = first.get("input")
            message = f"'{param}': {message}" + ("" if isinstance(got, (dict, list)) else f" (got {got!r})")
        raise RequestError(message, param=param, code=first["type"]) from None


# -- responses ------------------------------------------------------------------------------------


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage; cached_tokens: prompt tokens the prefix cache served (not prefilled)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_choice(index: int, text: str, token_ids: list[int], finish_reason: str | None,
                      logprobs: dict | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
            "token_ids": list(token_ids)}


def completion_body(request_id: str, model: str, created: int, choices: list[dict], usage: dict) -> dict:
    return {"id": request_id, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": usage}


def completion_chunk(request_id: str, model: str, created: int, choice: dict) -> dict:
    return {"id": request_id, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def chat_choice(index: int, text: str, token_ids: list[int], finish_reason: str | None, logprobs: dict | None) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
            "finish_reason": finish_reason, "token_ids": list(token_ids)}


def chat_body(request_id: str, model: str, created: int, choices: list[dict], usage: dict) -> dict:
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": usage}


def chat_chunk(request_id: str, model: str, created: int, index: int, delta: dict, token_ids: list[int],
               finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
                         "token_ids": list(token_ids)}]}


def usage_chunk(request_id: str, model: str, created: int, obj: str, prompt_tokens: int,
                completion_tokens: int, cached_tokens: int = 0) -> dict:
    """The final chunk of a stream asked for with stream_options.include_usage: no choices, the usage."""
    return {"id": request_id, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage_body(prompt_tokens, completion_tokens, cached_tokens)}


def models_body(name: str, created: int, max_model_len: int, extra: dict | None = None) -> dict:
    card = {"id": name, "object": "model", "created": created, "owned_by": "hgc", "max_model_len": max_model_len}
    card.update(extra or {})
    return {"object": "list", "data": [card]}


def now() -> int:
    return int(time.time())
