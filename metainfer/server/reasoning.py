"""The reasoning split of Qwen3.6 output (vLLM's `--reasoning-parser qwen3`), incrementally.

The chat template opens the think block in the prompt (`<think>\\n`) unless thinking is off, so the
output starts inside the reasoning and closes it with `</think>`; a model that writes `<think>`
itself is accepted too. `ReasoningParser.feed` takes text deltas and returns `(kind, text)` pieces,
kind "reasoning" or "content". Contracts:
- the pieces, joined per kind, do not depend on how the text was split into deltas;
- tags never reach either kind; whitespace at the edges of the reasoning and right after
  `</think>` (the template's own `\\n` / `\\n\\n`) is dropped;
- output that ends before `</think>` (a length stop) is all reasoning when the prompt opened the
  block, and all content when it did not and the output did not open one.
"""

from __future__ import annotations

from metainfer.tokenizer import THINK_END, THINK_START

REASONING, CONTENT = "reasoning", "content"

Piece = tuple[str, str]


def partial_tag(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`."""
    longest = max(len(t) for t in tags) - 1
    for n in range(min(len(text), longest), 0, -1):
        tail = text[-n:]
        if any(t.startswith(tail) for t in tags):
            return n
    return 0


class ReasoningParser:
    """`<think>…</think>` split of one choice's output. `in_reasoning`: the prompt ends inside an open
    think block (the template's generation prompt with thinking on)."""

    def __init__(self, in_reasoning: bool) -> None:
        # states: "open" (before the reasoning: whitespace and an optional <think> are skipped),
        # "maybe" (content unless the output starts with <think>), "reasoning", "lead" (whitespace
        # after </think>), "content"
        self._state = "open" if in_reasoning else "maybe"
        self._tag_allowed = True  # "open": a leading <think> may still be skipped
        self._buf = ""
        self._ws = ""  # reasoning whitespace held back until more reasoning follows
        self._out: list[Piece] = []

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        while self._step(final=False):
            pass
        return self._take()

    def finish(self) -> list[Piece]:
        """The pieces still held back; the parser is spent afterwards."""
        while self._step(final=True):
            pass
        if self._buf:  # "reasoning" or "content" leftovers
            self._emit(REASONING if self._state == "reasoning" else CONTENT, self._buf)
            self._buf = ""
        self._ws = ""  # trailing reasoning whitespace is dropped
        return self._take()

    # ---- internals --------------------------------------------------------------------------
    def _take(self) -> list[Piece]:
        out, self._out = self._out, []
        return out

    def _emit(self, kind: str, text: str) -> None:
        if kind == REASONING:
            text = self._ws + text
            body = text.rstrip()
            self._ws = text[len(body) :]
            text = body
        if not text:
            return
        if self._out and self._out[-1][0] == kind:
            self._out[-1] = (kind, self._out[-1][1] + text)
        else:
            self._out.append((kind, text))

    def _step(self, final: bool) -> bool:
        """One transition; True when another may follow."""
        buf, state = self._buf, self._state
        if state == "maybe":
            if buf.startswith(THINK_START):
                self._buf, self._state, self._tag_allowed = buf[len(THINK_START) :], "open", False
                return True
            if not final and THINK_START.startswith(buf):
                return False  # empty, or a prefix of <think>: wait
            self._state = "content"
            return True
        if state == "open":
            rest = buf.lstrip()
            if self._tag_allowed and rest.startswith(THINK_START):
                self._buf, self._tag_allowed = rest[len(THINK_START) :], False
                return True
            if not rest or (not final and self._tag_allowed and THINK_START.startswith(rest)):
                self._buf = rest
                return False
            self._buf, self._state = rest, "reasoning"
            return True
        if state == "reasoning":
            i = buf.find(THINK_END)
            if i >= 0:
                self._emit(REASONING, buf[:i])
                self._ws = ""
                self._buf, self._state = buf[i + len(THINK_END) :], "lead"
                return True
            keep = 0 if final else partial_tag(buf, (THINK_END,))
            self._emit(REASONING, buf[: len(buf) - keep])
            self._buf = buf[len(buf) - keep :]
            return False
        if state == "lead":
            rest = buf.lstrip()
            self._buf = rest
            if rest:
                self._state = "content"
                return True
            return False
        # content: everything passes
        self._emit(CONTENT, buf)
        self._buf = ""
        return False
