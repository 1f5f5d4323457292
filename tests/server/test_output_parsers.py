"""The reasoning split and the tool-call parser on odd model outputs: each fed whole and split at
every boundary (chunks of 1..N characters, and random cuts) gives the same result."""

from __future__ import annotations

import json
import random

import pytest

from metainfer.server.chat_output import ChoiceParser
from metainfer.server.reasoning import ReasoningParser
from metainfer.server.tool_parser import ToolCallArgs, ToolCallParser, ToolCallStart, convert_param

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "scale": {"type": "number"},
                    "metric": {"type": "boolean"},
                    "opts": {"type": "object"},
                    "tags": {"type": "array"},
                    "note": {"type": ["string", "null"]},
                },
            },
        },
    },
    {"type": "function", "function": {"name": "now"}},
]


def chunkings(text: str, seed: int = 0) -> list[list[str]]:
    """The text whole, in chunks of every size up to 24 characters, and cut at random points."""
    out = [[text]]
    out += [[text[i : i + n] for i in range(0, len(text), n)] for n in range(1, min(len(text), 24) + 1)]
    rng = random.Random(seed)
    for _ in range(8):
        cuts = (
            sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
            if len(text) > 1
            else []
        )
        bounds = [0, *cuts, len(text)]
        out.append([text[a:b] for a, b in zip(bounds, bounds[1:])])
    return out


def run_choice(chunks: list[str], **kw) -> tuple[str | None, str, list[tuple[str, str]]]:
    """(reasoning, content, [(name, arguments)]) assembled from the stream of events."""
    p = ChoiceParser.for_request(**{"split_reasoning": True, "in_reasoning": True, "tools": TOOLS, **kw})
    events = [e for c in chunks for e in p.feed(c)] + p.finish()
    reasoning, content, calls = "", "", {}
    for e in events:
        if isinstance(e, ToolCallStart):
            assert e.index == len(calls) and e.id.startswith("call_")
            calls[e.index] = [e.name, ""]
        elif isinstance(e, ToolCallArgs):
            calls[e.index][1] += e.fragment
        elif e.kind == "reasoning":
            reasoning += e.text
        else:
            content += e.text
    assembled = (reasoning or None, content, [tuple(c) for c in calls.values()])
    # the parser's own record (the non-streamed message) is the same
    assert assembled == (
        p.reasoning_text or None,
        p.content,
        [(c.name, c.arguments) for c in p.tool_calls],
    )
    for _, args in assembled[2]:
        assert isinstance(json.loads(args), dict)
    return assembled


CALL = (
    '<tool_call>\n<function=get_weather>\n<parameter=city>\nParis, "FR" \\ é\n</parameter>\n'
    "<parameter=days>\n3\n</parameter>\n<parameter=scale>\n2.5\n</parameter>\n"
    '<parameter=metric>\nTrue\n</parameter>\n<parameter=opts>\n{"a": [1, 2]}\n</parameter>\n'
    '<parameter=tags>\n["x"]\n</parameter>\n<parameter=note>\nnull\n</parameter>\n</function>\n</tool_call>'
)
CALL_ARGS = {
    "city": 'Paris, "FR" \\ é',
    "days": 3,
    "scale": 2.5,
    "metric": True,
    "opts": {"a": [1, 2]},
    "tags": ["x"],
    "note": None,
}

CASES = [  # (output, parser options, (reasoning, content, [(name, arguments as a dict)]))
    ("Hello, world.", {"in_reasoning": False}, (None, "Hello, world.", [])),
    ("Let me think.\n</think>\n\nThe answer is 4.", {}, ("Let me think.", "The answer is 4.", [])),
    ("<think>\nHmm.\n</think>\n\nYes.", {}, ("Hmm.", "Yes.", [])),
    ("<think>Hmm.</think>Yes.", {"in_reasoning": False}, ("Hmm.", "Yes.", [])),
    ("Plain <think> later", {"in_reasoning": False}, (None, "Plain <think> later", [])),
    ("Still thinking when cut off", {}, ("Still thinking when cut off", "", [])),
    ("cut at a tag </thi", {}, ("cut at a tag </thi", "", [])),
    ("no split </think> here", {"split_reasoning": False}, (None, "no split </think> here", [])),
    ("r</think>a < b and x<y, <tool_ and <function", {}, ("r", "a < b and x<y, <tool_ and <function", [])),
    (
        f"Thinking.</think>\n\nLet me check.\n\n{CALL}",
        {},
        ("Thinking.", "Let me check.", [("get_weather", CALL_ARGS)]),
    ),
    (f"</think>\n\n{CALL}\n{CALL}\n", {}, (None, "", [("get_weather", CALL_ARGS)] * 2)),
    (f"</think>{CALL}{CALL}", {"parallel_tool_calls": False}, (None, "", [("get_weather", CALL_ARGS)])),
    (f"</think>{CALL}\nAnd after.", {}, (None, "And after.", [("get_weather", CALL_ARGS)])),
    (
        '</think><tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n'
        "</tool_call>",
        {},
        (None, "", [("get_weather", {"city": "Rome", "days": 2})]),
    ),
    (
        '</think><tool_call>{"name": "now", "arguments": "{}"}</tool_call>',
        {},
        (None, "", [("now", {})]),
    ),
    (
        "</think><tool_call>\n<function=now>\n</function>\n</tool_call>",
        {},
        (None, "", [("now", {})]),
    ),
    (  # missing </parameter>, </function> and </tool_call>: cut off mid-value
        "</think><tool_call>\n<function=get_weather>\n<parameter=days>\n7\n<parameter=city>\nOs",
        {},
        (None, "", [("get_weather", {"days": 7, "city": "Os"})]),
    ),
    (  # two functions in one block, and a bare function of a known tool
        "</think><tool_call>\n<function=now>\n</function>\n<function=now>\n</function>\n</tool_call>"
        "<function=get_weather>\n<parameter=days>\nabc\n</parameter>\n</function>",
        {},
        (None, "", [("now", {}), ("now", {}), ("get_weather", {"days": "abc"})]),
    ),
    (  # stray text inside a function is skipped
        "</think><tool_call><function=now>junk<parameter=x>\n1\n</parameter>more</function></tool_call>",
        {},
        (None, "", [("now", {"x": "1"})]),
    ),
    ("</think>Use <function=unknown_fn> here", {}, (None, "Use <function=unknown_fn> here", [])),
    (
        "</think>Text <tool_call>garbage</tool_call> end",
        {},
        (None, "Text <tool_call>garbage</tool_call> end", []),
    ),
    (
        "</think>Text\n<tool_call>{bad json}</tool_call>",
        {},
        (None, "Text\n<tool_call>{bad json}</tool_call>", []),
    ),
    (
        '</think><tool_call>{"name": "now", "arguments": {"x": NaN}}</tool_call>',
        {},
        (None, '<tool_call>{"name": "now", "arguments": {"x": NaN}}</tool_call>', []),
    ),
    ("</think>Cut off <tool_call>\n<function=get_", {}, (None, "Cut off <tool_call>\n<function=get_", [])),
    ("</think>Cut off <tool_call>", {}, (None, "Cut off <tool_call>", [])),
    (
        "</think><tool_call><function=a\nb>x</function>",
        {},
        (None, "<tool_call><function=a\nb>x</function>", []),
    ),
    ("<tool_call>in reasoning</tool_call></think>ok", {}, ("<tool_call>in reasoning</tool_call>", "ok", [])),
    (f"</think>{CALL}", {"tools": None}, (None, CALL, [])),
    ("Hidden.</think>Shown.", {"include_reasoning": False}, (None, "Shown.", [])),
    ("", {}, (None, "", [])),
    ("  \n", {"split_reasoning": False, "tools": None}, (None, "  \n", [])),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_every_split_gives_the_whole_result(case: int) -> None:
    text, opts, (reasoning, content, calls) = CASES[case]
    expected = (reasoning, content, [(n, a) for n, a in calls])
    for chunks in chunkings(text, seed=case):
        r, c, got_calls = run_choice(chunks, **opts)
        assert (r, c, [(n, json.loads(a)) for n, a in got_calls]) == expected, chunks


def test_argument_fragments_and_ids() -> None:
    ids = iter(["call_a", "call_b"])
    p = ToolCallParser(TOOLS, new_id=lambda: next(ids))
    events = p.feed(CALL[:60]) + p.feed(CALL[60:] + CALL) + p.finish()
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    assert [(s.index, s.id, s.name) for s in starts] == [
        (0, "call_a", "get_weather"),
        (1, "call_b", "get_weather"),
    ]
    frags = [e.fragment for e in events if isinstance(e, ToolCallArgs) and e.index == 0]
    assert frags[0] == '{"city": "Paris, \\"FR\\" \\\\ é"' and frags[-1] == "}"
    assert json.loads("".join(frags)) == CALL_ARGS
    assert p.num_calls == 2


def test_reasoning_never_emits_a_tag() -> None:
    text = "<think>\nStep 1\n\nStep 2\n</think>\n\nDone"
    for chunks in chunkings(text):
        p = ReasoningParser(in_reasoning=True)
        pieces = [x for c in chunks for x in p.feed(c)] + p.finish()
        assert all("<" not in t for _, t in pieces)
        assert "".join(t for k, t in pieces if k == "reasoning") == "Step 1\n\nStep 2"


@pytest.mark.parametrize(
    "value,schema,expected",
    [
        ("42", {"type": "integer"}, 42),
        (" 42 ", {"type": "integer"}, 42),
        ("4.0", {"type": "integer"}, 4),
        ("4.5", {"type": "integer"}, "4.5"),
        ("1e3", {"type": "number"}, 1000.0),
        ("inf", {"type": "number"}, "inf"),
        ("nan", {"type": "number"}, "nan"),
        ("false", {"type": "boolean"}, False),
        ("yes", {"type": "boolean"}, "yes"),
        ("{'a': 1}", {"type": "object"}, "{'a': 1}"),
        ("[1]", {"type": "object"}, "[1]"),
        ("[1]", {"type": "array"}, [1]),
        ("null", {"type": "integer"}, "null"),
        ("null", {"type": ["integer", "null"]}, None),
        ("None", {"anyOf": [{"type": "integer"}, {"type": "null"}]}, None),
        ("7", {"anyOf": [{"type": "integer"}, {"type": "null"}]}, 7),
        ("7", {"type": "string"}, "7"),
        ("7", None, "7"),
        ("7", {"enum": ["7"]}, "7"),
        ("7", {"type": ["string", "integer"]}, "7"),
        ("[NaN]", {"type": "array"}, "[NaN]"),
        ("[" * 100_000, {"type": "array"}, "[" * 100_000),
        ("[" * 50_000 + "]" * 50_000, {"type": "array"}, "[" * 50_000 + "]" * 50_000),
    ],
)
def test_convert_param(value: str, schema, expected) -> None:
    assert convert_param(value, schema) == expected
