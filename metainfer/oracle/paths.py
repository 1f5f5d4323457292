"""Every engine path judged against the reference directly, on fresh prompts per path, and the
coverage a verdict records.

    checks, figures = path_checks(llm, reference, suite, gates)
    before = stats_snapshot(llm); ...; figures["coverage"] = coverage(before, dict(llm.engine.stats))

Each path gets its own random prompts (seeded from `suite.seed` and the path's name: never the
suite's, never another path's), one engine call, and the reference teacher-forced along the
engine's own tokens. Judged per path: every sampled row (the logits hook: the prefill's sampled row
and each decode or verify row) within the logits gates, the emitted greedy tokens equal to the
reference's argmax where its top-1 gap is clear, and the coverage the path exists for:

- `path.alone`: one prompt alone (a lone prefill step, then batch-1 decode steps: the decode CUDA
  graph on the GPU);
- `path.mixed`: two prompts arriving while three others decode (steps with prefill and decode rows);
- `path.preempt`: a wave sized from the engine's own cache so that KV blocks run out during decode
  and a request that already generated tokens is preempted and resumed (recompute): every
  request's tokens are judged, and the rows of the resumed requests from their resume on;
- `path.spec` (speculative engines only): four sequences drafting and verifying at once;
- `path.prefix` (prefix caching on): a conversation served from cache hits (`prefix_paths`).
"""

from __future__ import annotations

import torch

from metainfer.oracle.compare import Check, Gates
from metainfer.oracle.path_runs import SPEC_SEQS, _drive, _engine_config, _gen, _ids, _judge, _window
from metainfer.oracle.prefix_paths import prefix_path
from metainfer.oracle.suites import Suite


def _alone(llm, reference, suite: Suite, g: Gates) -> tuple[list[Check], dict]:
    eng = llm.engine
    gen_n = suite.gen_tokens
    n = max(2, min(eng.scheduler.token_budget * 3 // 4 + 1, eng.max_model_len - gen_n - 1))
    prompt = _ids(n, eng.model_config.vocab_size, _gen(suite, "alone"))
    with _window(llm) as cov:
        run = _drive(llm, [prompt], gen_n)
    reached = (cov["lone_prefill_steps"], 1, f"lone prefill steps; runner paths {cov['runner_paths']}")
    return _judge("alone", reference, run, g, cov, reached, {"prompt_lens": [n]})


def _mixed(llm, reference, suite: Suite, g: Gates) -> tuple[list[Check], dict]:
    eng = llm.engine
    gen_n = suite.gen_tokens
    cap = eng.max_model_len - gen_n - 1
    lens = [min(k, cap) for k in (3, 9, 20, eng.scheduler.token_budget // 2 + 3, 2)]
    gen = _gen(suite, "mixed")
    prompts = [_ids(k, eng.model_config.vocab_size, gen) for k in lens]
    with _window(llm) as cov:
        run = _drive(llm, prompts, gen_n, late_from=3, late_after=2)
    reached = (
        cov["mixed_steps"],
        1,
        f"steps with prefill and decode rows (widest decode {cov['max_decode_batch']})",
    )
    return _judge("mixed", reference, run, g, cov, reached, {"prompt_lens": lens, "late_from": 3})


def preempt_plan(llm, margin: int = 4) -> dict:
    """A wave that must preempt, sized from the engine's cache: W prompts of P tokens, G tokens each.

    W is as wide as max_num_seqs and the free state slots allow, and W * P fits the scheduler's
    token budget, so every prompt is prefilled in the first step and the wave decodes in lockstep.
    Each request's sequence ends in its b-th block, b = ceil((free blocks + 1) / W): W * (b - 1)
    blocks fit the cache, W * b do not. When the wave's decodes cross into their b-th block the
    cache runs out and the scheduler preempts (recompute) a request that has generated tokens,
    whatever it reserved ahead (MTP reserves draft KV blocks); the victim resumes once others
    finish, `margin` + 1 tokens before its end at least. Each request alone fits (b blocks,
    P + G < max_model_len).
    -> {"W", "P", "G", "blocks_each", cache sizes}, or {"error": why, cache sizes}."""
    eng = llm.engine
    cache, sch = eng.cache, eng.scheduler
    bs, free, budget, mml = cache.block_size, cache.blocks.num_free, sch.token_budget, eng.max_model_len
    w = min(sch.max_num_seqs, cache.slots.num_free, budget)
    plan = dict(free_blocks=free, block_size=bs, state_slots=cache.slots.num_free,
                max_num_seqs=sch.max_num_seqs, token_budget=budget, max_model_len=mml)  # fmt: skip
    b = -(-(free + 1) // max(1, w))
    p = max(1, budget // max(1, w))
    g = (b - 1) * bs + 2 - p + margin
    if w < 2 or g < 2 or p + g >= mml:
        why = f"{w} sequences (max_num_seqs, state slots, budget) of < {mml} tokens fit {free} blocks of {bs}"
        return {**plan, "error": why + ": this engine cannot run out of KV blocks"}
    return {**plan, "W": w, "P": p, "G": g, "blocks_each": b}


def _preempt(llm, reference, suite: Suite, g: Gates) -> tuple[list[Check], dict]:
    eng = llm.engine
    plan = preempt_plan(llm)
    if "error" in plan:
        fig = {"plan": plan, "coverage": {}}
        return [Check("path.preempt.coverage", None, ">= 1 resumed request", False, plan["error"])], fig
    gen = _gen(suite, "preempt")
    prompts = [_ids(plan["P"], eng.model_config.vocab_size, gen) for _ in range(plan["W"])]
    # no drafts while the whole wave runs: accepted drafts would let some requests finish early and
    # free their blocks before the others need theirs (speculation is judged by path.spec)
    spec_seqs = min(eng.ecfg.speculative_max_seqs, plan["W"] - 1)
    with _engine_config(eng, speculative_max_seqs=spec_seqs), _window(llm) as cov:
        run = _drive(llm, prompts, plan["G"], resumed_rows_only=True)
    resumed = run.resumed()
    what = (
        f"requests resumed after a preemption with generated tokens ({cov['preemptions']} "
        f"preemptions; wave of {plan['W']} x ({plan['P']} + {plan['G']}) tokens in "
        f"{plan['free_blocks']} blocks of {plan['block_size']})"
    )
    rows_from = {i: run.resume_pos(i) for i in resumed}
    fig = {"plan": plan, "resumed": resumed, "resumed_at": rows_from}
    return _judge("preempt", reference, run, g, cov, (len(resumed), 1, what), fig, rows_from)


def _spec(llm, reference, suite: Suite, g: Gates) -> tuple[list[Check], dict]:
    """SPEC_SEQS prompts built so that every sequence has n-gram drafts at its first decode step
    (`_spec_prompt`), so they verify together. For the call, the engine's `speculative_max_seqs` is
    raised to SPEC_SEQS (it limits how many sequences may draft, not how they verify) and its probe
    backoff is reset (a performance policy that earlier batches set)."""
    eng = llm.engine
    gen = _gen(suite, "spec")
    w = min(SPEC_SEQS, eng.scheduler.max_num_seqs, eng.cache.slots.num_free)
    prompts = [_spec_prompt(reference, eng.model_config.vocab_size, gen) for _ in range(w)]
    gen_n = min(suite.gen_tokens, eng.max_model_len - len(prompts[0]) - 1)
    ecfg = eng.ecfg
    eng.reset_spec_backoff()  # earlier batches' proposals that found nothing must not delay these
    with _engine_config(eng, speculative_max_seqs=max(ecfg.speculative_max_seqs, w)), _window(llm) as cov:
        run = _drive(llm, prompts, gen_n)
    wide = cov["max_verify_batch"] if cov["spec_drafted"] > 0 else 0
    what = (
        f"sequences verifying in one step (need >= 2, and drafts: {cov['spec_drafted']} drafted, "
        f"{cov['spec_accepted']} accepted in {cov['spec_verifies']} verifies, mode {ecfg.speculative})"
    )
    fig = {"sequences": w, "drafted": cov["spec_drafted"], "accepted": cov["spec_accepted"]}
    return _judge("spec", reference, run, g, cov, (wide, 2, what), fig)


def _spec_prompt(reference, vocab: int, gen: torch.Generator, tries: int = 3) -> list[int]:
    """A prompt X whose greedy continuation y0 the n-gram drafter finds after X's last token: X
    starts with [X[-1], y0, y1, y2, r] + 8 random ids (y the reference's greedy continuation of the
    random ids, r a random id), so once the engine emits y0 the drafts are y1, y2 (usually
    accepted), then r (usually rejected). The reference's y0 is checked on X itself (the front
    changes the context): rebuilt up to `tries` times."""
    body = _ids(8, vocab, gen)
    for _ in range(tries):
        y = _chain(reference, body, 3)
        x = [body[-1], *y, *_ids(1, vocab, gen), *body]
        if int(reference.logits(x)[-1].argmax()) == y[0]:
            break
        body = x
    return x


def _chain(reference, ids: list[int], n: int) -> list[int]:
    """The reference's greedy continuation of `ids`, n tokens (n forwards)."""
    out = list(ids)
    for _ in range(n):
        out.append(int(reference.logits(out)[-1].argmax()))
    return out[len(ids) :]


def path_checks(llm, reference, suite: Suite, gates: Gates) -> tuple[list[Check], dict]:
    """Every path against the reference directly (module docstring), on an idle engine.
    -> (checks: path.<name>.logits / .tokens / .coverage per path, figures: {name: figures})."""
    if llm.engine.has_unfinished():
        raise RuntimeError("path_checks needs an idle engine: the preemption wave is sized to its free cache")
    paths = [("alone", _alone), ("mixed", _mixed), ("preempt", _preempt)]
    if llm.engine.ecfg.speculative:
        paths.append(("spec", _spec))
    if llm.engine.cache.prefix_caching:
        paths.append(("prefix", prefix_path))
    checks: list[Check] = []
    figures: dict = {}
    for name, fn in paths:
        cs, figures[name] = fn(llm, reference, suite, gates)
        checks += cs
    return checks, figures
