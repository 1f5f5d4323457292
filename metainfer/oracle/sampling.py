"""Sampling, stops and logprobs judged against the reference.

The engine's sampler is a pure function of (logits, parameters, seed, step), so the oracle redoes it
on the reference's logits. The noise contract it restates (documented by the engine's sampler, not
imported from it: the two are compared by a unit test):

    mix(x)  = x ^= x >> 16; x = x * 0x45D9F3B mod 2^32; x ^= x >> 16; x = x * 0x45D9F3B mod 2^32;
              x ^ (x >> 16)
    key     = mix(lo ^ mix(hi ^ mix(step)))     lo, hi: low and high 32 bits of (seed mod 2^64)
    u[i]    = ((mix((i * 0x9E3779B1 mod 2^32) ^ key) >> 9) + 0.5) / 2^23     for token id i
    token   = argmax over the ids the filters keep of logits / T - ln(-ln u)

`step` is the number of tokens the request had generated before this one. The filters follow vLLM:
the temperature divides the logits; min-p drops ids whose probability (of the tempered distribution)
is below min_p times the largest; top-k keeps the k largest; top-p, on what min-p and top-k kept,
keeps the smallest set of best ids whose mass reaches p (the best id always stays).

A position is judged only where the choice is clear: the perturbed score of the oracle's choice
beats every other id that might survive the filters by clear_gap / T (the logit margin of the
precision, compare.GATES), and the choice itself survives every filter with that margin (top-k:
fewer than k ids within the margin above it; min-p: its log-ratio to every other id clears ln(min_p)
by the margin; top-p: the mass before it, moved by the margin, stays below p).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from metainfer.engine.request import SamplingParams
from metainfer.oracle.compare import GATES, Check, allowed_misses
from metainfer.oracle.engine_runs import capture_rows
from metainfer.oracle.suites import ORDINARY_IDS, Suite

_M32 = 0xFFFFFFFF
TEMPERATURES = (0.6, 1.3)
FILTERS: tuple[tuple[str, dict], ...] = (
    ("none", {}),
    ("top_k", {"top_k": 2}),
    ("top_p", {"top_p": 0.5}),
    ("min_p", {"min_p": 0.3}),
)
PROMPTS_PER_CONFIG = 2
GREEDY_PROMPTS = 3
LOGPROBS = 5
MIN_JUDGED = 20  # judged sampled positions, at least (besides GATES.min_clear_frac of them)
# (max, mean) |engine - reference| logprob, nats; honest CPU engines measure far below (README)
LOGPROB_GATES = {"float32": (2e-4, 2e-5), "bfloat16": (4.0, 0.25), "fp8": (12.0, 0.75)}
SELF_GATE = 1e-3  # |engine logprob - log_softmax of the engine's own row|, nats, every precision
EOS_TEXTS = (  # a document or a chat turn that ends: a trained model's next token is EOS
    'import sys\n\n\ndef main():\n    print("hello")\n\n\nif __name__ == "__main__":\n    main()\n',
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    "<think>\n\n</think>\n\nThe capital of France is Paris.",
)


def _mix32(x: np.ndarray | int) -> np.ndarray | int:
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    return x ^ (x >> 16)


def noise_uniform(seed: int, step: int, vocab: int) -> np.ndarray:
    """u in (0, 1), float64 [vocab], for one request's `step` (the contract in the module doc)."""
    s = seed % (1 << 64)
    key = _mix32((s & _M32) ^ _mix32((s >> 32) ^ _mix32(step & _M32)))
    ids = np.arange(vocab, dtype=np.uint64)
    h = _mix32(((ids * np.uint64(0x9E3779B1)) & np.uint64(_M32)) ^ np.uint64(key))
    return ((h >> np.uint64(9)).astype(np.float64) + 0.5) / float(1 << 23)


@dataclass(frozen=True)
class Config:
    name: str
    temperature: float
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0


@dataclass(frozen=True)
class Choice:
    token: int  # the oracle's choice
    judged: bool  # the choice is clear (module doc)
    bite: bool  # the filters changed the choice (unfiltered argmax differs)
    gap: float  # perturbed score of the choice minus the best possible survivor's, tempered units


def _shift(mass: torch.Tensor, a: float) -> torch.Tensor:
    """A set's probability mass when its logits move by `a` (tempered units) against the rest's."""
    return mass * math.exp(a) / (mass * math.exp(a) + 1 - mass)


def oracle_choice(logits: torch.Tensor, cfg: Config, seed: int, step: int, margin: float) -> Choice:
    """logits [V] (raw, any float dtype, any device) -> the oracle's token and whether it is clear
    at `margin` (a logit margin: the precision's clear gap)."""
    x = logits.double() / cfg.temperature
    a, V, dev = margin / cfg.temperature, x.shape[0], x.device
    g = -torch.log(-torch.log(torch.from_numpy(noise_uniform(seed, step, V)).to(dev)))
    nominal = torch.ones(V, dtype=torch.bool, device=dev)
    sure, maybe = nominal.clone(), nominal.clone()  # surely kept / possibly kept under the margin
    best = int(x.argmax())
    if cfg.min_p > 0:
        top2 = x.topk(min(2, V)).values
        other = torch.full_like(x, float(top2[0]))  # the best of the other ids
        other[best] = top2[-1]
        ln_m = math.log(cfg.min_p)
        nominal &= x - top2[0] >= ln_m
        sure &= x - other >= ln_m + a
        maybe &= x - other >= ln_m - a
    if 0 < cfg.top_k < V:  # fewer than k ids above x - a: surely kept; k ids above x + a: dropped
        v_k, v_next = x.topk(cfg.top_k + 1).values[-2:]
        nominal &= x >= v_k
        sure &= x >= v_next + a
        maybe &= x >= v_k - a
    if cfg.top_p < 1:  # the mass of the ids above each one, on what min-p and top-k kept
        xs, order = x.sort()
        q = x.masked_fill(~nominal, -math.inf).softmax(-1)
        mass = q.sum() - torch.cat([q.new_zeros(1), q[order].cumsum(0)])  # [V + 1]: above xs[i-1]

        def above(v: torch.Tensor) -> torch.Tensor:
            return mass[torch.searchsorted(xs, v, right=True)]

        nominal &= above(x) < cfg.top_p
        nominal[best] = True
        sure &= _shift((above(x - a) - q).clamp(0, 1), a) < cfg.top_p
        maybe &= _shift(above(x + a), -a) < cfg.top_p
        maybe[best] = True
    s = x + g
    c = int(s.masked_fill(~nominal, -math.inf).argmax())
    maybe[c] = False
    gap = float(s[c] - s.masked_fill(~maybe, -math.inf).max())
    return Choice(c, bool(sure[c]) and gap >= a, int(s.argmax()) != c, gap)


def configs() -> list[Config]:
    return [Config(f"T{t:g}-{name}", t, **kw) for t in TEMPERATURES for name, kw in FILTERS]


def _seeds(base: int, n: int) -> list[int]:
    """Small, 64-bit, >= 2^63 and negative seeds: every bit of the contract's seed is used."""
    out = []
    for i in range(n):
        s = base * 7919 + 104729 * i
        out.append([s, s * 0x9E3779B97F4A7C15 % (1 << 64), (1 << 64) - 1 - s, -(s + 1)][i % 4])
    return out


def _prompts(suite: Suite, vocab: int, n: int, lo: int, hi: int) -> list[list[int]]:
    """n fresh random prompts (seeded by the suite's seed), none equal to a suite prompt."""
    gen = torch.Generator().manual_seed(suite.seed * 1_000_003 + 0x5A3)
    taken = {tuple(p.token_ids) for p in suite.prompts}
    out: list[list[int]] = []
    while len(out) < n:
        k = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        p = torch.randint(0, min(vocab, ORDINARY_IDS), (k,), generator=gen).tolist()
        if tuple(p) not in taken:
            taken.add(tuple(p))
            out.append(p)
    return out


def _generate(llm, prompts: list[list[int]], params: list[SamplingParams]):
    """One continuous batch -> (final outputs, per request {position: the logits row it sampled
    from}) (the rows of requests with logprobs only, through the runner's logits hook)."""
    eng = llm.engine
    ids = [eng.new_request_id() for _ in prompts]
    want = {rid: i for i, (rid, sp) in enumerate(zip(ids, params)) if sp.logprobs is not None}
    final: dict[str, object] = {}
    with capture_rows(llm, want) as store:
        for rid, p, sp in zip(ids, prompts, params):
            eng.add_request(p, sp, request_id=rid)
        while len(final) < len(ids) and eng.has_unfinished():
            final.update({o.request_id: o for o in eng.step() if o.finished})
    store += [{} for _ in range(len(prompts) - len(store))]
    missing = [rid for rid in ids if rid not in final]
    if missing:
        raise RuntimeError(f"engine idle with {len(missing)} requests unfinished")
    return [final[rid] for rid in ids], store


def sampling_checks(llm, reference, suite: Suite, precision: str) -> tuple[list[Check], dict]:
    """Runs fresh seeded sampled, greedy and stop requests through `llm` (two engine batches) and
    judges them against `reference` (`logits(ids) -> [L, V] fp32`, one forward per request).
    -> checks sampling.tokens, sampling.stops, sampling.logprobs; their figures."""
    t0 = time.perf_counter()
    g = GATES[precision]
    full = suite.name == "full"
    n_tok, cfgs = (16 if full else 12), configs()
    n_s = len(cfgs) * PROMPTS_PER_CONFIG
    vocab = int(llm.engine.model_config.vocab_size)
    prompts = _prompts(suite, vocab, n_s + GREEDY_PROMPTS, 16 if full else 4, 48 if full else 20)
    seeds = _seeds(suite.seed + 1, n_s)
    req_cfg = [cfgs[i % len(cfgs)] for i in range(n_s)]
    params = [
        SamplingParams(max_tokens=n_tok, temperature=c.temperature, top_k=c.top_k, top_p=c.top_p,
                       min_p=c.min_p, seed=seeds[i], ignore_eos=True, detokenize=False,
                       logprobs=LOGPROBS if i < len(cfgs) else None)  # half of them: both paths
        for i, c in enumerate(req_cfg)
    ]
    greedy = SamplingParams(max_tokens=n_tok, temperature=0.0, ignore_eos=True, logprobs=LOGPROBS)
    outs, rows_seen = _generate(llm, prompts, params + [greedy] * GREEDY_PROMPTS)
    problems = [f"request {i}: {o.error or o.finish_reason}, {len(o.token_ids)} of {n_tok} tokens"
                for i, o in enumerate(outs) if o.error or len(o.token_ids) != n_tok]
    per_cfg = {c.name: dict.fromkeys(("positions", "judged", "mismatches", "bites", "judged_bites"), 0)
               for c in cfgs}
    first = {"judged": 0, "mismatches": 0}  # the first sampled token of each request
    mism: list[str] = []
    lp = _LogprobStats(g.clear_gap)
    greedy_gaps: list[list[float]] = []  # per greedy request: ref top-1 gap, -1 where not its argmax
    for i, (p, o) in enumerate(zip(prompts, outs)):
        toks = list(o.token_ids)
        rows = reference.logits(p + toks)[len(p) - 1 : len(p) - 1 + len(toks)].double()
        if o.logprobs is not None:
            lp.add(i, toks, o.logprobs, rows, [rows_seen[i].get(len(p) - 1 + j) for j in range(len(toks))])
        if i >= n_s:
            top = rows.topk(2, dim=-1)
            gap = (top.values[:, 0] - top.values[:, 1]).tolist()
            greedy_gaps.append([x if int(t) == e else -1.0 for x, t, e in zip(gap, top.indices[:, 0], toks)])
            continue
        f = per_cfg[req_cfg[i].name]
        for j, tok in enumerate(toks):
            ch = oracle_choice(rows[j], req_cfg[i], seeds[i], j, g.clear_gap)
            f["positions"] += 1
            f["bites"] += ch.bite
            if ch.judged:
                f["judged"] += 1
                f["judged_bites"] += ch.bite
                f["mismatches"] += tok != ch.token
                first["judged"] += j == 0
                first["mismatches"] += j == 0 and tok != ch.token
                if tok != ch.token:
                    mism.append(f"{req_cfg[i].name} seed {seeds[i]} @{j}: engine {tok}, oracle {ch.token}")
    t_sampled = time.perf_counter() - t0
    stops = _stop_checks(llm, reference, prompts[n_s:], outs[n_s:], greedy_gaps, g.tie_gap, n_tok)
    judged = sum(f["judged"] for f in per_cfg.values())
    total = sum(f["positions"] for f in per_cfg.values())
    misses = sum(f["mismatches"] for f in per_cfg.values())
    frac = misses / judged if judged else math.nan
    allowed = 0.0 if precision == "float32" else g.max_mismatch_frac
    ok_misses = misses <= allowed_misses(allowed, judged)
    need = max(MIN_JUDGED, math.ceil(g.min_clear_frac * total))
    bites = {c: f["judged_bites"] for c, f in per_cfg.items() if f["judged_bites"]}
    eos = "exercised" if stops["eos_exercised"] else f"not exercised ({stops['eos_note']})"
    checks = [
        Check("sampling.tokens", None if math.isnan(frac) else frac,
              f"<= {allowed:g} (>= 1 token when > 0) where perturbed gap >= {g.clear_gap:g}/T",
              bool(ok_misses and judged >= need and not problems),
              "; ".join(problems[:2] + mism[:2])
              or f"{judged} of {total} sampled tokens judged (need >= {need}); judged filter bites: {bites}"),
        Check("sampling.stops", float(len(stops["failures"])), "== 0 failures", not stops["failures"],
              "; ".join(stops["failures"][:2]) or f"{stops['judged']} stop requests judged; EOS {eos}"),
        lp.check(precision),
    ]
    figures = {"per_config": per_cfg, "first_token": first, "mismatches": mism[:20], "problems": problems,
               "tokens_per_request": n_tok, "requests": len(prompts), "stops": stops,
               "logprobs": lp.figures(),
               "timing_s": {"sampled_and_greedy": round(t_sampled, 3),
                            "total": round(time.perf_counter() - t0, 3)}}
    return checks, figures


class _LogprobStats:
    """Engine logprobs (chosen id and top-N) vs the reference's log_softmax at the same positions,
    and vs log_softmax of the engine's own row (the one the token was sampled from)."""

    def __init__(self, clear: float) -> None:
        self.clear, self.errs, self.self_errs, self.problems = clear, [], [], []

    def add(self, i: int, toks: list[int], entries, rows: torch.Tensor, own: list) -> None:
        """rows [N, V]: the reference's; own: the engine's row per position (None if not seen)."""
        if len(entries) != len(toks):
            self.problems.append(f"request {i}: {len(entries)} logprob entries for {len(toks)} tokens")
        for j, (tok, e, r) in enumerate(zip(toks, entries, rows.log_softmax(-1))):
            pairs = [(e.token_id, e.logprob), *e.top]
            self.errs += [abs(v - float(r[t])) for t, v in pairs]
            if own[j] is None:
                self.problems.append(f"request {i} @{j}: the logits hook did not deliver its row")
            else:
                o = own[j].double().to(r.device).log_softmax(-1)
                self.self_errs += [abs(v - float(o[t])) for t, v in pairs]
            top = r.topk(LOGPROBS + 1)
            ids, ref_ids = sorted(t for t, _ in e.top), sorted(top.indices[:LOGPROBS].tolist())
            values = [v for _, v in e.top]
            if e.token_id != tok or len(ids) != LOGPROBS or values != sorted(values, reverse=True):
                self.problems.append(f"request {i} @{j}: entry {e.token_id} vs token {tok}, top {e.top}")
            elif float(top.values[-2] - top.values[-1]) >= self.clear and ids != ref_ids:
                self.problems.append(f"request {i} @{j}: top ids {ids} vs the reference's {ref_ids}")

    def figures(self) -> dict:
        e, o = (torch.tensor(x or [math.nan], dtype=torch.float64) for x in (self.errs, self.self_errs))
        return {"values": len(self.errs), "max_abs_err": float(e.max()), "mean_abs_err": float(e.mean()),
                "self_max_abs_err": float(o.max()), "problems": self.problems[:10]}

    def check(self, precision: str) -> Check:
        f, (g_max, g_mean) = self.figures(), LOGPROB_GATES[precision]
        ok = f["max_abs_err"] <= g_max and f["mean_abs_err"] <= g_mean and f["self_max_abs_err"] <= SELF_GATE
        detail = "; ".join(self.problems[:2]) or (f"mean {f['mean_abs_err']:.3g} over {f['values']} values; "
                                                  f"vs the engine's own rows max {f['self_max_abs_err']:.3g}")
        return Check("sampling.logprobs", None if math.isnan(f["max_abs_err"]) else f["max_abs_err"],
                     f"max <= {g_max:g}, mean <= {g_mean:g} vs the reference; <= {SELF_GATE:g} vs own rows",
                     bool(ok and not self.problems), detail)


@dataclass(frozen=True)
class _Expect:
    tokens: list[int]
    finish: str
    reason: int | str | None
    text: str | None = None


def _expected(toks: list[int], clear: int, stops: set[int], eos: set[int], min_tokens: int,
              max_tokens: int) -> tuple[_Expect | None, int]:
    """What a greedy request must return, from its ignore_eos greedy tokens `toks` (the first
    `clear` of them certain) -> (the outcome, or None where it needs tokens past what is certain;
    how many leading tokens are certain). As in vLLM, stop ids and EOS cannot be generated before
    min_tokens tokens exist: a greedy token that is one ends the certain prefix."""
    stop_ids = stops | eos
    for j, t in enumerate(toks[:max_tokens]):
        if j >= clear or (j < min_tokens and t in stop_ids):
            return None, j
        if t in stop_ids:
            return _Expect(toks[: j + 1], "stop", None if t in eos else t), j + 1
    done = clear >= max_tokens
    return (_Expect(toks[:max_tokens], "length", None) if done else None), min(clear, max_tokens)


def _consistent(o, sp: SamplingParams, eos: set[int]) -> list[str]:
    """Whatever the tokens, the finish must agree with them (vLLM's semantics): no stop id or EOS
    among the first min_tokens tokens, none left unacted on after them, a stop reason that names the
    id that stopped it, "length" only at max_tokens."""
    toks, stops = list(o.token_ids), set(sp.stop_token_ids) | (set() if sp.ignore_eos else eos)
    out = [f"generated stop id {t} at {j}, before min_tokens {sp.min_tokens} (vLLM bans them)"
           for j, t in enumerate(toks[: sp.min_tokens]) if t in stops][:1]
    late = [j for j in range(sp.min_tokens, len(toks) - 1) if toks[j] in stops]
    out += [f"ran past stop id {toks[late[0]]} at {late[0]}"] if late else []
    if o.finish_reason == "length" and len(toks) != sp.max_tokens:
        out.append(f"length after {len(toks)} of {sp.max_tokens} tokens")
    elif o.finish_reason == "stop" and not sp.stop:
        last = toks[-1] if toks else None
        want = None if last in eos and not sp.ignore_eos else last
        if last not in stops or len(toks) <= sp.min_tokens or o.stop_reason != want:
            out.append(f"stop at token {last} (#{len(toks)}, min_tokens {sp.min_tokens}), "
                       f"stop_reason {o.stop_reason!r}")
    elif o.finish_reason not in ("stop", "length"):
        out.append(f"finish_reason {o.finish_reason!r} ({o.error})")
    return out


def _stop_string(tok, toks: list[int], clear: int, text: str) -> tuple[str, int, int] | None:
    """A substring of the greedy text inside its clear prefix, first seen mid-text: (s, its offset,
    tokens needed to complete it), or None."""
    clear_text = tok.decode(toks[:clear], skip_special_tokens=True)
    cands = [o for o in range(1, len(clear_text) - 2)
             if "\ufffd" not in (s := clear_text[o : o + 3]) and s.strip() and text.find(s) == o
             and text[: o + 3] == clear_text[: o + 3]]
    if not cands:
        return None
    o = cands[len(cands) // 2]
    s = clear_text[o : o + 3]
    n = next((j for j in range(1, clear + 1) if s in tok.decode(toks[:j], skip_special_tokens=True)), None)
    return None if n is None else (s, o, n)


def _stop_checks(llm, reference, prompts, outs, gaps, tie: float, n_tok: int) -> dict:
    """Greedy reruns of the base prompts with stop ids (and min_tokens), stop strings (with and
    without the string in the output), without ignore_eos, and EOS where the reference says a prompt
    ends with it: finish_reason, stop_reason, tokens and text against what the greedy run implies."""
    vocab, tok = int(llm.engine.model_config.vocab_size), llm.tokenizer
    eos = {e for e in llm.engine.eos_token_ids if 0 <= e < vocab}
    base = []  # (prompt, greedy tokens, clear prefix, text)
    for p, o, gp in zip(prompts, outs, gaps):
        base.append((p, list(o.token_ids), next((j for j, x in enumerate(gp) if x < tie), len(gp)), o.text))
    base.sort(key=lambda b: -b[2])
    reqs: list[tuple[list[int], SamplingParams, _Expect | None, list[int]]] = []  # ..., certain tokens
    for p, g, cp, _ in base:
        sp = SamplingParams(max_tokens=n_tok, temperature=0.0, detokenize=False)
        exp, n = _expected(g, cp, set(), eos, 0, n_tok)
        reqs.append((p, sp, exp, g[:n]))
    p, g, cp, _ = base[0]  # stop at a first occurrence near 3, inside the clear prefix if possible
    ks = sorted((j for j in range(min(4, len(g))) if g[j] not in g[:j] and g[j] not in eos),
                key=lambda j: (j < cp, j))
    if ks:
        k, absent = ks[-1], next(t for t in range(vocab) if t not in g and t not in eos)
        for mt in (0, k + 2):
            sp = SamplingParams(max_tokens=n_tok, temperature=0.0, stop_token_ids=(absent, g[k]),
                                min_tokens=mt, detokenize=False)
            exp, n = _expected(g, cp, {absent, g[k]}, eos, mt, n_tok)
            reqs.append((p, sp, exp, g[:n]))
    strings = None
    for p, g, cp, text in base:
        found = _stop_string(tok, g, cp, text) if text else None
        if found:
            s, off, n = found
            strings = {"string": s, "offset": off, "tokens": n}
            for inc in (False, True):
                sp = SamplingParams(max_tokens=n_tok, temperature=0.0, stop=(s,), ignore_eos=True,
                                    include_stop_str_in_output=inc)
                reqs.append((p, sp, _Expect(g[:n], "stop", s, text[: off + len(s) * inc]), g[:n]))
            break
    note = "no EOS id inside the vocabulary" if not eos else "no prompt ends in a clear EOS"
    if eos and getattr(tok, "vocab_size", vocab + 1) <= vocab:
        for t in EOS_TEXTS:
            ids = tok.encode(t)
            if not ids or max(ids) >= vocab:
                continue
            top = reference.logits(ids)[-1].topk(2)
            if int(top.indices[0]) in eos and float(top.values[0] - top.values[1]) >= tie:
                e = int(top.indices[0])
                sp = SamplingParams(max_tokens=n_tok, temperature=0.0, detokenize=False)
                reqs.append((ids, sp, _Expect([e], "stop", None), [e]))
                sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, detokenize=False)
                reqs.append((ids, sp, None, [e]))
                sp = SamplingParams(max_tokens=3, temperature=0.0, min_tokens=2, detokenize=False)
                reqs.append((ids, sp, None, []))  # EOS is banned for two tokens
                break
    eos_hit = any(x.finish == "stop" and x.reason is None for _, _, x, _ in reqs if x is not None)
    outs2 = llm.generate(prompt_token_ids=[r[0] for r in reqs], sampling_params=[r[1] for r in reqs])
    failures, judged = [], 0
    for i, ((_, sp, exp, certain), o) in enumerate(zip(reqs, outs2)):
        what = f"stop request {i} (stop ids {list(sp.stop_token_ids)}, stop {list(sp.stop)}, " \
               f"min_tokens {sp.min_tokens}, ignore_eos {sp.ignore_eos})"
        bad = [] if sp.stop else _consistent(o, sp, eos)
        toks = list(o.token_ids)
        if toks[: len(certain)] != certain:
            bad.append(f"tokens {toks} do not start with the greedy run's certain {certain}")
        if exp is not None:
            judged += 1
            got = (toks, o.finish_reason, o.stop_reason)
            if got != (exp.tokens, exp.finish, exp.reason):
                bad.append(f"got {got}, expected {(exp.tokens, exp.finish, exp.reason)}")
            if exp.text is not None and o.text != exp.text:
                bad.append(f"text {o.text!r}, expected {exp.text!r}")
        failures += [f"{what}: {b}" for b in bad]
    return {"requests": len(reqs), "judged": judged, "failures": failures, "stop_string": strings
            or "not exercised (no clean substring in a clear greedy prefix)", "eos_exercised": eos_hit,
            "eos_note": "" if eos_hit else note, "clear_prefixes": [b[2] for b in base]}
