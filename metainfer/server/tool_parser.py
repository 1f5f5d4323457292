"""Qwen3.6 tool-call markup -> OpenAI tool calls, incrementally (vLLM's `qwen3_coder` format).

The model writes a call as
    <tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>
(a bare `<function=…>…</function>` and several functions in one block are accepted too), or in the
JSON form `<tool_call>{"name": …, "arguments": {…}}</tool_call>`. `ToolCallParser.feed` takes text
deltas and returns events: content text (str), `ToolCallStart` and `ToolCallArgs`. Contracts:
- the events do not depend on how the text was split into deltas (argument fragments are emitted per
  complete parameter, so even their boundaries do not);
- a call's fragments, joined, are one JSON object; parameter values are converted by the tool's JSON
  schema (integer, number, boolean, object, array, null) and kept as strings otherwise;
- markup never reaches content: a block found malformed before its function name is known is
  returned as content verbatim; a call that has started is closed with what was parsed;
- whitespace between content and a call block, and between blocks, is dropped.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from metainfer.server.reasoning import partial_tag

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
FUNCTION_START, FUNCTION_END = "<function=", "</function>"
PARAM_START, PARAM_END = "<parameter=", "</parameter>"
MAX_NAME = 256  # a function or parameter name longer than this is not markup
_BODY_TAGS = (PARAM_START, FUNCTION_END, TOOL_CALL_END)
_VALUE_ENDS = (PARAM_END, PARAM_START, FUNCTION_END, TOOL_CALL_END)
_LONGEST_VALUE_END = max(len(t) for t in _VALUE_ENDS)


@dataclass(frozen=True)
class ToolCallStart:
    index: int  # position among the calls of this choice
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgs:
    index: int
    fragment: str  # the next piece of the call's JSON arguments


Event = str | ToolCallStart | ToolCallArgs


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_schemas(tools: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Function name -> {parameter name: its JSON schema}, from OpenAI `tools`."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            continue
        params = fn.get("parameters")
        props = params.get("properties") if isinstance(params, Mapping) else None
        out[fn["name"]] = dict(props) if isinstance(props, Mapping) else {}
    return out


def _schema_types(schema: Any) -> set[str]:
    if not isinstance(schema, Mapping):
        return set()
    t = schema.get("type")
    if isinstance(t, str):
        types = {t}
    else:
        types = {x for x in t if isinstance(x, str)} if isinstance(t, list) else set()
    for key in ("anyOf", "oneOf"):
        subs = schema.get(key)
        for sub in subs if isinstance(subs, list) else ():
            types |= _schema_types(sub)
    return types


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _loads(text: str) -> Any:
    """Strict JSON (no NaN / Infinity); ValueError for anything else, deep nesting included."""
    try:
        return json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


def convert_param(value: str, schema: Any) -> Any:
    """A parameter's text as the JSON value its schema asks for; the text itself when the schema
    asks for a string, says nothing, or the text does not parse as the type."""
    types = _schema_types(schema)
    text = value.strip()
    if "null" in types and text.lower() in ("null", "none"):
        return None
    if not types or "string" in types:
        return value
    if "boolean" in types and text.lower() in ("true", "false"):
        return text.lower() == "true"
    if types & {"integer", "number"}:
        try:
            return int(text)
        except ValueError:
            pass
        try:
            f = float(text)
        except ValueError:
            f = math.nan
        if math.isfinite(f) and "integer" in types and f.is_integer():
            return int(f)
        if math.isfinite(f) and "number" in types:
            return f
    if types & {"object", "array"}:
        try:
            parsed = _loads(text)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict) and "object" in types or isinstance(parsed, list) and "array" in types:
            return parsed
    return value


def _json_call(body: str) -> tuple[str, str] | None:
    """(name, JSON arguments) of the JSON form's body, or None when it is not one."""
    try:
        obj = _loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"].strip():
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = _loads(args) if args.strip() else {}
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"].strip(), _dumps(args)


@dataclass
class _Call:
    index: int
    name: str
    emit: bool  # False: parsed past and dropped (parallel_tool_calls false, not the first call)
    num_params: int = 0


class ToolCallParser:
    """Tool calls out of one choice's content text. `tools`: the request's tool definitions (for
    parameter types); `parallel`: False keeps only the first call."""

    def __init__(
        self,
        tools: Sequence[Mapping[str, Any]] = (),
        parallel: bool = True,
        new_id: Callable[[], str] = new_call_id,
    ) -> None:
        self._schemas = tool_schemas(tools)
        self._parallel = parallel
        self._new_id = new_id
        self._buf = ""
        # states: text, open (after <tool_call>), name (after <function=), json, body (inside a
        # function), value (a parameter's value), after (after </function>)
        self._state = "text"
        self._scan = 0  # "json" / "value": the buffer before this holds no end tag
        self._ws = ""  # content whitespace held back until more content follows
        self._dropped = ""  # whitespace dropped before the open block, restored if it is malformed
        self._raw = ""  # markup consumed since the block opened, restored if it is malformed
        self._after_call = False  # content right after a call: leading whitespace dropped
        self._wrapped = False  # inside <tool_call>: a function of any name is a call (bare: a tool's)
        self._call: _Call | None = None
        self._key = ""
        self._num_calls = 0
        self._num_emitted = 0
        self._out: list[Event] = []

    @property
    def num_calls(self) -> int:
        """Calls emitted so far."""
        return self._num_emitted

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        while self._step(final=False):
            pass
        return self._take()

    def finish(self) -> list[Event]:
        """Closes what is open; the parser is spent afterwards."""
        while self._step(final=True):
            pass
        if self._ws and not self._after_call:
            self._emit_text(self._ws)
        self._ws = ""
        return self._take()

    # ---- output -----------------------------------------------------------------------------
    def _take(self) -> list[Event]:
        out, self._out = self._out, []
        return out

    def _emit_text(self, text: str) -> None:
        if self._out and isinstance(self._out[-1], str):
            self._out[-1] += text
        else:
            self._out.append(text)

    def _content(self, text: str) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        text = self._ws + text
        body = text.rstrip()
        self._ws = text[len(body) :]
        if body:
            self._emit_text(body)

    def _open(self, raw: str, state: str, wrapped: bool) -> None:
        """A block starts: the held whitespace goes, unless the block turns out malformed."""
        self._dropped, self._ws, self._raw, self._state, self._wrapped = self._ws, "", raw, state, wrapped

    def _malformed(self, consumed: str = "") -> None:
        """The open block was not a call: its text (and `consumed` of the buffer) is content."""
        self._ws = self._dropped
        self._content(self._raw + consumed)
        self._raw = self._dropped = ""
        self._state, self._wrapped = "text", False

    def _start_call(self, name: str) -> None:
        emit = self._parallel or self._num_calls == 0
        self._num_calls += 1
        self._call = _Call(self._num_emitted, name, emit)
        self._raw = self._dropped = ""
        if emit:
            self._num_emitted += 1
            self._out.append(ToolCallStart(self._call.index, self._new_id(), name))

    def _add_param(self, key: str, value: str) -> None:
        call = self._call
        assert call is not None
        if value.startswith("\n"):
            value = value[1:]
        if value.endswith("\n"):
            value = value[:-1]
        converted = convert_param(value, self._schemas.get(call.name, {}).get(key))
        if call.emit:
            sep = "{" if call.num_params == 0 else ", "
            self._out.append(ToolCallArgs(call.index, f"{sep}{_dumps(key)}: {_dumps(converted)}"))
        call.num_params += 1

    def _close_call(self) -> None:
        call = self._call
        if call is not None and call.emit:
            self._out.append(ToolCallArgs(call.index, "}" if call.num_params else "{}"))
        self._call = None

    # ---- the state machine ------------------------------------------------------------------
    def _step(self, final: bool) -> bool:
        """One transition; True when another may follow."""
        return getattr(self, f"_on_{self._state}")(self._buf, final)

    def _on_text(self, buf: str, final: bool) -> bool:
        hits = [(i, t) for t in (TOOL_CALL_START, FUNCTION_START) if (i := buf.find(t)) >= 0]
        if hits:
            i, tag = min(hits)
            self._content(buf[:i])
            self._buf = buf[i + len(tag) :]
            wrapped = tag == TOOL_CALL_START
            self._open(tag, "open" if wrapped else "name", wrapped)
            return True
        keep = 0 if final else partial_tag(buf, (TOOL_CALL_START, FUNCTION_START))
        self._content(buf[: len(buf) - keep])
        self._buf = buf[len(buf) - keep :]
        return False

    def _on_open(self, buf: str, final: bool) -> bool:
        rest = buf.lstrip()
        self._raw += buf[: len(buf) - len(rest)]
        self._buf = rest
        if rest.startswith(FUNCTION_START):
            self._raw += FUNCTION_START
            self._buf, self._state = rest[len(FUNCTION_START) :], "name"
            return True
        if rest.startswith("{"):
            self._state, self._scan = "json", 0
            return True
        if not final and FUNCTION_START.startswith(rest):
            return False  # empty, or a prefix of <function=: wait
        self._malformed()
        return True

    def _on_name(self, buf: str, final: bool) -> bool:
        j = buf.find(">")
        head = buf if j < 0 else buf[:j]
        if "<" in head or "\n" in head.strip() or len(head) > MAX_NAME or (j < 0 and final):
            self._malformed()
            return True
        if j < 0:
            return False
        name = head.strip()
        if not name or not (self._wrapped or name in self._schemas):
            self._malformed()
            return True
        self._start_call(name)
        self._buf, self._state = buf[j + 1 :], "body"
        return True

    def _on_json(self, buf: str, final: bool) -> bool:
        k = buf.find(TOOL_CALL_END, self._scan)
        if k < 0 and not final:
            self._scan = max(0, len(buf) - len(TOOL_CALL_END) + 1)
            return False
        body, end, rest = (buf, "", "") if k < 0 else (buf[:k], TOOL_CALL_END, buf[k + len(TOOL_CALL_END) :])
        parsed = _json_call(body)
        if parsed is None:
            self._buf = rest
            self._malformed(body + end)
            return True
        self._start_call(parsed[0])
        call = self._call
        assert call is not None
        if call.emit:
            self._out.append(ToolCallArgs(call.index, parsed[1]))
        self._call = None
        self._leave_block(rest)
        return True

    def _on_body(self, buf: str, final: bool) -> bool:
        rest = buf.lstrip()
        self._buf = rest
        if rest.startswith(PARAM_START):
            j = rest.find(">", len(PARAM_START))
            name = rest[len(PARAM_START) : j if j >= 0 else len(rest)]
            plausible = len(name) <= MAX_NAME and "<" not in name and "\n" not in name.strip()
            if j >= 0 and plausible and name.strip():
                self._key, self._buf, self._state, self._scan = name.strip(), rest[j + 1 :], "value", 0
                return True
            if j < 0 and plausible and not final:
                return False  # the name is still coming
        elif rest.startswith(FUNCTION_END):
            self._close_call()
            self._buf, self._state = rest[len(FUNCTION_END) :], "after"
            return True
        elif rest.startswith(TOOL_CALL_END):
            self._close_call()
            self._leave_block(rest[len(TOOL_CALL_END) :])
            return True
        elif not final and any(t.startswith(rest) for t in _BODY_TAGS):
            return False  # empty, or a prefix of a tag: wait
        # stray text inside the function (or a malformed tag) is skipped up to the next tag
        nxt = rest.find("<", 1)
        if nxt >= 0:
            self._buf = rest[nxt:]
            return True
        self._buf = ""
        if final:
            self._close_call()
            self._leave_block("")
        return False

    def _on_value(self, buf: str, final: bool) -> bool:
        hits = [(i, t) for t in _VALUE_ENDS if (i := buf.find(t, self._scan)) >= 0]
        if not hits:
            if final:
                self._add_param(self._key, buf)
                self._close_call()
                self._leave_block("")
            else:
                self._scan = max(0, len(buf) - _LONGEST_VALUE_END + 1)
            return False
        i, tag = min(hits)
        self._add_param(self._key, buf[:i])
        self._buf = buf[i + len(PARAM_END) :] if tag == PARAM_END else buf[i:]
        self._state = "body"
        return True

    def _on_after(self, buf: str, final: bool) -> bool:
        rest = buf.lstrip()
        self._buf = rest
        if rest.startswith(TOOL_CALL_END):
            self._leave_block(rest[len(TOOL_CALL_END) :])
            return True
        if rest.startswith(FUNCTION_START):
            self._buf = rest[len(FUNCTION_START) :]
            self._open(FUNCTION_START, "name", self._wrapped)
            return True
        if not final and (TOOL_CALL_END.startswith(rest) or FUNCTION_START.startswith(rest)):
            return False
        self._leave_block(rest)
        return True

    def _leave_block(self, rest: str) -> None:
        self._buf, self._state, self._after_call, self._wrapped = rest, "text", True, False
