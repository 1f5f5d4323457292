"""OpenAI / vLLM wire formats (pydantic v2): requests, responses, stream chunks, errors."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StrictInt,
    StrictStr,
    model_serializer,
)

MAX_N = 128  # OpenAI's limit on choices per request
MAX_LOGPROBS = 20


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class APIError(Exception):
    """An error answered as an OpenAI-style JSON body with `status`."""

    TYPES = {
        400: "BadRequestError",
        401: "AuthenticationError",
        404: "NotFoundError",
        413: "BadRequestError",
        500: "InternalServerError",
        503: "ServiceUnavailableError",
    }

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.status, self.param)


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    err_type = APIError.TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---- requests -------------------------------------------------------------------------------------


class _Request(BaseModel):
    """Unknown fields are kept (`model_extra`) for `unsupported_fields` to name."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Request):
    name: StrictStr | None = None
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Request):
    """vLLM's `structured_outputs` extra-body field (one constraint of the five)."""

    json_: StrictStr | dict[str, Any] | None = Field(None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    json_object: bool | None = None


class SamplingFields(_Request):
    """Sampling fields shared by completions and chat (OpenAI names plus vLLM's extensions)."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_tokens_as_token_ids: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # structured outputs (server.structured): OpenAI's response_format and vLLM's extra-body forms
    response_format: ResponseFormat | None = None
    guided_json: StrictStr | dict[str, Any] | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    structured_outputs: StructuredOutputs | None = None


class CompletionRequest(SamplingFields):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: int | None = Field(16, ge=0)  # 0: only with echo (the prompt alone)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class FunctionCallParam(_Request):
    name: StrictStr
    arguments: StrictStr | dict[str, Any] | None = None  # a JSON object, or its text (OpenAI's form)


class ToolCallParam(_Request):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessage(_Request):
    role: StrictStr
    content: StrictStr | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    reasoning_content: str | None = None  # assistant: its reasoning, rendered back (either name)
    reasoning: str | None = None


class FunctionDefinition(_Request):
    name: StrictStr = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; its property types convert arguments
    strict: bool | None = None  # accepted; arguments are enforced only under a grammar


class ChatTool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: StrictStr


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    include_reasoning: bool = True  # vLLM's: False drops the reasoning from the response


class TokenizeCompletionRequest(_Request):
    model: str | None = None
    prompt: StrictStr
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Request):
    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[StrictInt]


# Fields clients send that change nothing here, accepted with any value
IGNORED_FIELDS = frozenset(
    {"store", "metadata", "service_tier", "safety_identifier", "prompt_cache_key", "include_obfuscation"}
)
# vLLM / OpenAI fields accepted while they hold the value that asks for nothing this server lacks
DEFAULT_FIELDS: dict[str, Any] = {
    "echo": False,
    "continue_final_message": False,
    "add_special_tokens": False,
    "use_beam_search": False,
    "spaces_between_special_tokens": True,
    "modalities": ["text"],
}


def unsupported_fields(model: BaseModel, path: str = "") -> list[str]:
    """The fields of a request (its messages, tools and options included) that this server does not
    implement, by path (`messages[1].audio`); null and empty values count as absent."""
    out = []
    for key, value in (model.model_extra or {}).items():
        if value is None or value == [] or value == {} or key in IGNORED_FIELDS:
            continue
        default = DEFAULT_FIELDS.get(key, ...)
        if value == default and isinstance(value, bool) == isinstance(default, bool):
            continue
        out.append(path + key)
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            out.extend(unsupported_fields(value, f"{path}{name}."))
        elif isinstance(value, list):
            for j, item in enumerate(value):
                if isinstance(item, BaseModel):
                    out.extend(unsupported_fields(item, f"{path}{name}[{j}]."))
    return out


def reject_unsupported_fields(model: BaseModel) -> None:
    """APIError 400 naming every field `unsupported_fields` finds."""
    names = unsupported_fields(model)
    if names:
        verb = "is" if len(names) == 1 else "are"
        raise APIError(f"{', '.join(names)} {verb} not supported by this server", 400, names[0])


# ---- responses ------------------------------------------------------------------------------------


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object's text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    """The reasoning is given under vLLM's current name (`reasoning`) and its earlier one."""

    role: str = "assistant"
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class _DropNone(BaseModel):
    """Serialised without its None fields (stream deltas carry only what they change)."""

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_DropNone):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_DropNone):
    """A call's first fragment has id, type and name (arguments ""); the rest add arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(_DropNone):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "metainfer"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    vocab_size: int | None = None  # MetaInfer's addition: token ids a prompt may hold are < this
    # MetaInfer's additions: where the model runs ("cpu", "cuda:0 (GPU name)") and its shape, so that
    # `bench serve` can tell whether its roofline (a GPU, a model) describes this server
    device: str | None = None
    hidden_size: int | None = None
    num_hidden_layers: int | None = None
    num_experts: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str
