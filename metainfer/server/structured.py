"""Structured outputs on the wire: the request's constraint fields -> one engine StructuredSpec.

Accepted forms (vLLM's OpenAI server): `response_format` {"type": "json_object"} and
{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}; the extra-body fields
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (Lark, or GBNF with `::=` rules);
and `structured_outputs` {"json" | "regex" | "choice" | "grammar" | "json_object"}. At most one
constraint per request. A forced tool call (tool_choice "required" or a named function) is a Lark
grammar over the JSON tool-call form `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`
(tool_parser reads it as it reads the XML form), the arguments held to the tool's parameters schema.
Schemas, regexes and grammars are compiled by the engine when the request is added: a bad one is a
400 there, before anything is queued.
"""

from __future__ import annotations

import json
from typing import Any

from metainfer.engine.grammar import StructuredSpec, _closed
from metainfer.server.protocol import APIError, SamplingFields


def _schema(value: Any, param: str) -> dict | bool:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise APIError(f"{param} is not valid JSON: {e}", 400, param) from None
    if not isinstance(value, (dict, bool)):
        raise APIError(f"{param} must be a JSON schema (an object)", 400, param)
    return value


def _grammar(text: str, param: str) -> StructuredSpec:
    if "::=" in text:  # GBNF (vLLM's examples): llguidance converts it to Lark
        try:
            from llguidance.gbnf_to_lark import gbnf_to_lark

            text = gbnf_to_lark(text)
        except ImportError:
            raise APIError("structured outputs need the llguidance package", 400, param) from None
        except Exception as e:
            raise APIError(f"{param} is not a valid GBNF grammar: {e}", 400, param) from None
    return StructuredSpec("grammar", text)


def structured_spec(req: SamplingFields) -> StructuredSpec | None:
    """The request's output constraint, or None; APIError 400 for a malformed or doubled one."""
    found: list[tuple[str, StructuredSpec]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", StructuredSpec("json_object")))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise APIError('response_format "json_schema" needs json_schema.schema', 400, "response_format")
        found.append(("response_format", StructuredSpec.json_schema(
            _schema(rf.json_schema.schema_, "response_format.json_schema.schema"))))
    if req.guided_json is not None:
        found.append(("guided_json", StructuredSpec.json_schema(_schema(req.guided_json, "guided_json"))))
    if req.guided_regex is not None:
        found.append(("guided_regex", StructuredSpec("regex", req.guided_regex)))
    if req.guided_choice is not None:
        found.append(("guided_choice", StructuredSpec.choice(req.guided_choice)))
    if req.guided_grammar is not None:
        found.append(("guided_grammar", _grammar(req.guided_grammar, "guided_grammar")))
    so = req.structured_outputs
    if so is not None:
        p = "structured_outputs"
        if so.json_ is not None:
            found.append((p, StructuredSpec.json_schema(_schema(so.json_, p + ".json"))))
        if so.regex is not None:
            found.append((p, StructuredSpec("regex", so.regex)))
        if so.choice is not None:
            found.append((p, StructuredSpec.choice(so.choice)))
        if so.grammar is not None:
            found.append((p, _grammar(so.grammar, p + ".grammar")))
        if so.json_object:
            found.append((p, StructuredSpec("json_object")))
    if any(s.kind == "choice" and not json.loads(s.value) for _, s in found):
        raise APIError("a choice constraint needs at least one string", 400, found[0][0])
    if len(found) > 1:
        raise APIError(f"at most one output constraint per request, got {len(found)} "
                       f"({', '.join(n for n, _ in found)})", 400, found[1][0])
    return found[0][1] if found else None


def tool_call_spec(tools: list[dict], name: str | None, parallel: bool) -> StructuredSpec:
    """A grammar that forces tool calls in the JSON form: of the function `name`, or (None) of any
    of `tools`; one call, or one or more when `parallel`."""
    alts = []
    for t in tools:
        fn = t["function"]
        if name is not None and fn["name"] != name:
            continue
        params = _closed(fn.get("parameters") or {"type": "object", "properties": {}})
        schema = {
            "type": "object",
            "properties": {"name": {"const": fn["name"]}, "arguments": params},
            "required": ["name", "arguments"],
            "additionalProperties": False,
            "x-guidance": {"whitespace_flexible": False},  # compact: the model cannot pad forever
        }
        alts.append("%json " + json.dumps(schema))
    body = "call: " + "\n    | ".join(alts)
    start = 'start: call_block ("\\n" call_block)*' if parallel else "start: call_block"
    lark = f'{start}\ncall_block: "<tool_call>\\n" call "\\n</tool_call>"\n{body}\n'
    return StructuredSpec("grammar", lark)
