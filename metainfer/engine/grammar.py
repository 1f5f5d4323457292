"""Structured outputs: grammars compiled by llguidance, one matcher per request, token masks.

A request's constraint is a `StructuredSpec` (a JSON schema, any JSON object, a regex, a choice of
strings or a Lark grammar). `GrammarBackend.compile` turns it into an llguidance grammar and checks
it against the engine's tokenizer, raising `GrammarError` with a client-facing message; the engine
calls it before a request is queued. `GrammarBackend.matcher` gives the request its matcher.

The matcher follows the request's generated tokens (`Matcher.sync`: it consumes whatever the
request took since the last call, so a recomputed or resumed request only re-feeds what is new).
Each step the runner fills one bitmask row per constrained request on the host
(`fill_bitmask`) and applies the rows on the logits' device with one masked_fill (`apply_bitmask`).
The EOS ids are allowed by the mask only where the grammar accepts.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import torch

KINDS = ("json", "json_object", "regex", "choice", "grammar")


class GrammarError(ValueError):
    """A constraint that cannot be compiled (bad schema, regex or grammar): the client's error."""


@dataclass(frozen=True)
class StructuredSpec:
    """One output constraint. value: the schema as JSON text (json), the regex (regex), the choices
    as a JSON list of strings (choice), a Lark grammar (grammar); empty for json_object.
    after_thinking: the output starts inside the model's reasoning (the prompt ends with <think>):
    any text up to the first </think> (and the newlines after it) is free, the constraint binds the
    rest (as vLLM applies a grammar after its reasoning parser's end)."""

    kind: str
    value: str = ""
    after_thinking: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown structured output kind {self.kind!r} ({', '.join(KINDS)})")

    @classmethod
    def json_schema(cls, schema: dict | bool) -> StructuredSpec:
        return cls("json", json.dumps(schema))  # key order kept: properties are generated in it

    @classmethod
    def choice(cls, options: Sequence[str]) -> StructuredSpec:
        return cls("choice", json.dumps(list(options)))


def _lark_string(s: str) -> str:
    return json.dumps(s)  # a JSON string literal is a Lark string literal


def _closed(schema):
    """The schema with additionalProperties: false on every object schema that leaves it unset (as
    vLLM's default backend does: the output has the listed properties, not free-form extra keys)."""
    if isinstance(schema, list):
        return [_closed(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    if ("properties" in out or out.get("type") == "object") and "additionalProperties" not in out \
            and isinstance(out.get("properties", {}), dict) and "patternProperties" not in out:
        if "properties" in out:
            out["additionalProperties"] = False
    return out


# free text up to the first </think> (lazy: the first one ends it), then the newlines, then the answer
THINKING_LARK = 'start: think "\\n"* @answer\nthink[lazy]: /(?s:.*)<\\/think>/\n'


def grammar_text(spec: StructuredSpec) -> str:
    """The spec as an llguidance grammar (JSON text); GrammarError for a malformed value."""
    g = _grammar_text(spec)
    if not spec.after_thinking:
        return g
    try:
        entry = json.loads(g)["grammars"][0]  # the JSON form (schemas, regexes)
    except ValueError:
        entry = {"lark_grammar": g}  # Lark text (choices, grammars)
    entry = {**entry, "name": "answer"}
    return json.dumps({"grammars": [{"name": "thinking", "lark_grammar": THINKING_LARK}, entry]})


def _grammar_text(spec: StructuredSpec) -> str:
    import llguidance

    M = llguidance.LLMatcher
    opts = {"whitespace_flexible": False}  # compact JSON: fewer tokens, no runaway whitespace
    try:
        if spec.kind == "json":
            return M.grammar_from_json_schema(_closed(json.loads(spec.value)), defaults=opts)
        if spec.kind == "json_object":
            return M.grammar_from_json_schema({"type": "object"}, defaults=opts)
        if spec.kind == "regex":
            return M.grammar_from_regex(spec.value)
        if spec.kind == "choice":
            options = json.loads(spec.value)
            if not options or not all(isinstance(o, str) for o in options):
                raise GrammarError("choice needs a non-empty list of strings")
            return M.grammar_from_lark("start: " + " | ".join(_lark_string(o) for o in options))
        return M.grammar_from_lark(spec.value)
    except (ValueError, TypeError) as e:
        if isinstance(e, GrammarError):
            raise
        raise GrammarError(f"invalid {spec.kind} constraint: {e}") from None


class _TokenTable:
    """What llguidance.LLTokenizer reads from a tokenizer it does not know: every id's bytes, the
    special ids, the EOS id and an encode callable."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self._tok = tokenizer
        n = min(tokenizer.vocab_size, vocab_size)
        self.tokens: list[bytes] = []
        self.special_token_ids: list[int] = []
        by_bytes = getattr(tokenizer, "decode_bytes", None)
        byte_level = None if by_bytes is not None else _byte_level_decoder()
        for i in range(n):
            if tokenizer.decode([i], skip_special_tokens=True) == "" and tokenizer.decode([i]) != "":
                self.special_token_ids.append(i)
                self.tokens.append(tokenizer.decode([i]).encode())
            elif by_bytes is not None:
                self.tokens.append(by_bytes([i]))
            else:
                self.tokens.append(_hf_token_bytes(tokenizer, i, byte_level))
        self.tokens += [b""] * (vocab_size - n)  # padded ids: never allowed
        self.eos_token_id = eos_ids[0]
        self.bos_token_id = None

    def __call__(self, s: str) -> list[int]:
        return self._tok.encode(s)


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE's printable character -> byte map (the inverse of bytes_to_unicode)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _hf_token_bytes(tokenizer, i: int, byte_level: dict[str, int]) -> bytes:
    """An HF byte-level BPE token's bytes (its vocabulary string mapped back through byte_level);
    a token outside that alphabet (an added token) as its UTF-8 text."""
    s = tokenizer._tok.id_to_token(i) if hasattr(tokenizer, "_tok") else None
    if s is None:
        return tokenizer.decode([i]).encode()
    if all(c in byte_level for c in s):
        return bytes(byte_level[c] for c in s)
    return s.encode()


class GrammarBackend:
    """The engine's grammar compiler: the tokenizer table built once, compiled grammars cached."""

    CACHE = 256  # compiled grammars kept (a server sees the same few schemas again and again)

    def __init__(self, tokenizer, vocab_size: int, eos_ids: Sequence[int]) -> None:
        import llguidance

        self._ll = llguidance
        self.vocab_size = vocab_size
        self.eos_ids = tuple(eos_ids)
        self.tokenizer = llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(_TokenTable(tokenizer, vocab_size, self.eos_ids)),
            n_vocab=vocab_size, eos_token=list(self.eos_ids),
        )
        self._cache: dict[StructuredSpec, str] = {}

    def compile(self, spec: StructuredSpec) -> str:
        """The validated grammar of `spec`; GrammarError (client-facing) when it cannot be used."""
        g = self._cache.get(spec)
        if g is not None:
            return g
        g = grammar_text(spec)
        is_err, msgs = self._ll.LLMatcher.validate_grammar_with_warnings(g, self.tokenizer)
        if is_err:
            raise GrammarError(f"invalid {spec.kind} constraint: {msgs[0] if msgs else 'rejected'}")
        m = self._ll.LLMatcher(self.tokenizer, g, log_level=0)
        if m.is_error():
            raise GrammarError(f"invalid {spec.kind} constraint: {m.get_error()}")
        if len(self._cache) >= self.CACHE:
            self._cache.pop(next(iter(self._cache)))
        self._cache[spec] = g
        return g

    def matcher(self, spec: StructuredSpec) -> Matcher:
        return Matcher(self._ll.LLMatcher(self.tokenizer, self.compile(spec), log_level=0), self.vocab_size)


class Matcher:
    """A request's grammar state; `fed` tokens of its output consumed so far."""

    def __init__(self, m, vocab: int) -> None:
        self._m = m
        self.vocab = vocab
        self.fed = 0

    def sync(self, output_token_ids: Sequence[int]) -> None:
        """Consumes the output tokens taken since the last call (all of them after a reset)."""
        if len(output_token_ids) < self.fed:  # tokens dropped: start over
            self._m.reset()
            self.fed = 0
        new = list(output_token_ids[self.fed :])
        assert all(t >= 0 for t in new), "a constrained request's tokens must be on the host"
        if new:
            self._m.consume_tokens(new)
            self.fed += len(new)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the allowed next tokens into bitmask[row] (int32, on the host). A matcher in an
        error state (a token it rejected) allows only EOS, so the request ends."""
        v = bitmask[row]
        self._m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())

    @property
    def error(self) -> str:
        return self._m.get_error() if self._m.is_error() else ""


def bitmask_words(vocab: int) -> int:
    return (vocab + 31) // 32


_EXECUTOR = None


def fill_bitmask(matchers: Sequence[Matcher], vocab: int, pin: bool = False) -> torch.Tensor:
    """The next-token bitmask [len(matchers), bitmask_words(vocab)] int32 on the host (pinned: for
    an asynchronous copy to the GPU), row j for matchers[j]; rows filled in parallel on llguidance's
    thread pool when there are several."""
    global _EXECUTOR
    import llguidance

    bm = torch.empty(len(matchers), bitmask_words(vocab), dtype=torch.int32, pin_memory=pin)
    if len(matchers) == 1:
        matchers[0].fill(bm, 0)
        return bm
    if _EXECUTOR is None:
        _EXECUTOR = llguidance.LLExecutor()
    _EXECUTOR.unsafe_compute_mask_ptr([(m._m, j) for j, m in enumerate(matchers)], bm.data_ptr(),
                                      bm.shape[1] * 4, bm.shape[0])
    return bm


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [B, V] with the tokens not allowed by bitmask [n, W] (int32, on logits' device) set to
    -inf in the logits rows `rows` [n] (int64, same device); one masked_fill, no host sync."""
    V = logits.shape[-1]
    shifts = _SHIFTS.get(logits.device)
    if shifts is None:
        shifts = _SHIFTS[logits.device] = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).bool().reshape(bitmask.shape[0], -1)[:, :V]
    full = torch.ones(logits.shape, dtype=torch.bool, device=logits.device)
    full[rows] = allowed
    return logits.masked_fill(~full, float("-inf"))


def mask_logits(logits: torch.Tensor, reqs: Sequence) -> torch.Tensor:
    """logits [len(reqs), V] with the row of every request that has a grammar masked by it, after
    its matcher has taken the request's output tokens (the step's caller keeps them on the host)."""
    rows = [j for j, r in enumerate(reqs) if r.grammar is not None]
    matchers = [reqs[j].grammar for j in rows]
    for j, m in zip(rows, matchers):
        m.sync(reqs[j].output_token_ids)
    dev = logits.device
    bm = fill_bitmask(matchers, matchers[0].vocab, pin=dev.type == "cuda")
    idx = torch.tensor(rows, dtype=torch.int64).to(dev, non_blocking=True)
    return apply_bitmask(logits, idx, bm.to(dev, non_blocking=True))
