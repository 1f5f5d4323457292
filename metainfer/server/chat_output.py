"""One chat choice's output text -> reasoning, content and tool calls, as deltas and as a whole.

The reasoning split runs first; the tool-call parser then reads the content only (calls inside the
reasoning are not calls). A non-streamed message is one `feed` of the whole text and `finish`, so
a stream's deltas always add up to the non-streamed message.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from metainfer.server.reasoning import REASONING, ReasoningParser
from metainfer.server.tool_parser import ToolCallArgs, ToolCallParser, ToolCallStart


@dataclass(frozen=True)
class TextDelta:
    kind: str  # "reasoning" or "content"
    text: str


ChatEvent = TextDelta | ToolCallStart | ToolCallArgs


@dataclass
class ParsedToolCall:
    id: str
    name: str
    arguments: str = ""  # JSON object text


@dataclass
class ChoiceParser:
    """`reasoning`: None to keep the think block in the content (reasoning parser off, or thinking
    off); `tools`: None to leave tool markup in the content (no tools, or tool_choice "none");
    `include_reasoning` False drops the reasoning (vLLM's `include_reasoning`)."""

    reasoning: ReasoningParser | None = None
    tools: ToolCallParser | None = None
    include_reasoning: bool = True
    reasoning_text: str = ""
    content: str = ""
    tool_calls: list[ParsedToolCall] = field(default_factory=list)

    @classmethod
    def for_request(
        cls,
        split_reasoning: bool,
        in_reasoning: bool,
        tools: Sequence[Mapping[str, Any]] | None,
        parallel_tool_calls: bool = True,
        include_reasoning: bool = True,
    ) -> ChoiceParser:
        return cls(
            reasoning=ReasoningParser(in_reasoning) if split_reasoning else None,
            tools=ToolCallParser(tools, parallel_tool_calls) if tools is not None else None,
            include_reasoning=include_reasoning,
        )

    def feed(self, text: str) -> list[ChatEvent]:
        pieces = self.reasoning.feed(text) if self.reasoning is not None else [("content", text)]
        return self._route(pieces, finish=False)

    def finish(self) -> list[ChatEvent]:
        """What was held back; call once, after the last `feed`."""
        pieces = self.reasoning.finish() if self.reasoning is not None else []
        return self._route(pieces, finish=True)

    def _route(self, pieces: list[tuple[str, str]], finish: bool) -> list[ChatEvent]:
        out: list[ChatEvent] = []
        for kind, text in pieces:
            if kind == REASONING:
                if self.include_reasoning:
                    out.append(TextDelta(REASONING, text))
            elif self.tools is not None:
                out.extend(self._tool_event(e) for e in self.tools.feed(text))
            else:
                out.append(TextDelta("content", text))
        if finish and self.tools is not None:
            out.extend(self._tool_event(e) for e in self.tools.finish())
        return self._record(_merge(out))

    @staticmethod
    def _tool_event(e: str | ToolCallStart | ToolCallArgs) -> ChatEvent:
        return TextDelta("content", e) if isinstance(e, str) else e

    def _record(self, events: list[ChatEvent]) -> list[ChatEvent]:
        for e in events:
            if isinstance(e, TextDelta):
                if e.kind == REASONING:
                    self.reasoning_text += e.text
                else:
                    self.content += e.text
            elif isinstance(e, ToolCallStart):
                self.tool_calls.append(ParsedToolCall(e.id, e.name))
            else:
                self.tool_calls[e.index].arguments += e.fragment
        return events


def _merge(events: list[ChatEvent]) -> list[ChatEvent]:
    """Adjacent text of one kind, and adjacent argument fragments of one call, joined."""
    out: list[ChatEvent] = []
    for e in events:
        last = out[-1] if out else None
        if isinstance(e, TextDelta) and isinstance(last, TextDelta) and last.kind == e.kind:
            out[-1] = TextDelta(e.kind, last.text + e.text)
        elif isinstance(e, ToolCallArgs) and isinstance(last, ToolCallArgs) and last.index == e.index:
            out[-1] = ToolCallArgs(e.index, last.fragment + e.fragment)
        else:
            out.append(e)
    return out
