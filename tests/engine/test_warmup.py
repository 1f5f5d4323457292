"""The start-up warmup (ModelRunner.warmup): eager steps on the null state slot and KV block that
compile the kernels serving meets. It runs on CUDA by default; here it is called on the CPU
reference path to check its step shapes and that it leaves the engine's outputs unchanged."""

from __future__ import annotations

import pytest

from metainfer.engine.request import SamplingParams
from metainfer.engine.warmup import warmup_steps
from metainfer.llm import LLM
from tests.helpers import token_prompts


def _llm(max_num_seqs=6, max_model_len=256, **kw):
    kw = dict(max_num_batched_tokens=128, max_model_len=max_model_len, max_num_seqs=max_num_seqs, **kw)
    return LLM(device="cpu", dtype="float32", **kw)


@pytest.mark.parametrize("max_num_seqs, max_model_len", [(6, 256), (20, 256), (4, 40)])
def test_warmup_steps_fit_the_engine(max_num_seqs, max_model_len):
    llm = _llm(max_num_seqs, max_model_len=max_model_len)
    r, e = llm.engine.runner, llm.engine.ecfg
    assert r.warmup_s == 0.0  # CPU: not run at start
    steps = warmup_steps(e)
    budget = min(e.max_num_batched_tokens, e.max_model_len * e.max_num_seqs)
    assert any(sum(q) == budget for q, _ in steps)  # the full budget
    assert any(q[0] == 1 and len(q) > 2 for q, _ in steps)  # decodes mixed with prompts
    assert any(n > 1 and ctx > 0 for q, c in steps for n, ctx in zip(q, c))  # a prompt's later chunk
    for q, c in steps:
        assert len(q) == len(c) <= e.max_num_seqs and sum(q) <= e.max_num_batched_tokens
        assert all(a + b <= e.max_model_len for a, b in zip(q, c))
        decodes = [n == 1 for n in q]
        assert decodes == sorted(decodes, reverse=True)  # decodes first, as ForwardMeta wants
    assert any(sum(n == 1 for n in q) == 16 for q, _ in steps) == (max_num_seqs > 16)
    if max_num_seqs >= 4 and budget % 64 == 0:  # four prompts of a length divisible by 16
        assert ([budget // 4] * 4, [0] * 4) in steps


def test_eager_steps_use_capacity_wide_block_tables():
    """Eager steps build their block tables as wide as the warmup's and the graphs' (max_model_len's
    blocks), whatever the step's longest sequence: Triton specialises a kernel on its table's row
    stride (% 16), so a narrower table compiled new variants while serving (2.7 s on the H200)."""
    llm = _llm()
    r = llm.engine.runner
    widths = []
    hook = r.model.register_forward_pre_hook(lambda mod, args: widths.append(args[2].block_tables.shape[1]))
    try:
        sp = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        llm.generate(prompt_token_ids=token_prompts([5, 40, 9], seed=3), sampling_params=sp)
    finally:
        hook.remove()
    assert widths and set(widths) == {r.blocks_per_seq}
    assert r.blocks_per_seq > 40 // llm.engine.ecfg.block_size + 1  # wider than the longest sequence needs


def test_warmup_leaves_generations_unchanged():
    prompts = token_prompts([5, 40, 9], seed=3)
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    llm = _llm()
    before = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=sp)]
    assert llm.engine.runner.warmup() >= 0
    after = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=sp)]
    assert before == after
    usage = llm.engine.cache.usage()
    assert usage["kv_blocks_used"] == 0 and usage["state_slots_used"] == 0


def test_slow_launch_is_logged(caplog, monkeypatch):
    """A step whose launch takes long (a JIT compile on the GPU) is logged with its shape; on the CPU
    (every launch computes its step) at debug level only, so a CPU run's stderr stays quiet."""
    llm = _llm()
    monkeypatch.setattr(type(llm.engine), "SLOW_LAUNCH_S", 0.0)
    with caplog.at_level("WARNING", logger="metainfer.engine"):
        llm.generate(prompt_token_ids=token_prompts([7, 12]), sampling_params=SamplingParams(max_tokens=2))
    assert "slow step launch" not in caplog.text
    caplog.clear()
    with caplog.at_level("DEBUG", logger="metainfer.engine"):
        llm.generate(prompt_token_ids=token_prompts([7, 12]), sampling_params=SamplingParams(max_tokens=2))
    assert llm.engine.stats["slow_launches"] == llm.engine.stats["steps"] > 0
    assert "slow step launch" in caplog.text and "19 tokens" in caplog.text and "s (CPU " in caplog.text
    assert "Triton compiled: none; CPU" in caplog.text  # the CPU path compiles nothing, allocates no segments


def test_slow_launch_names_the_kernels_it_compiled(caplog, monkeypatch):
    """Triton's post-compile hook (called by hand here: the CPU path compiles nothing) records each
    compiled kernel's name; the slow launch's log line names those of its launch only."""
    from types import SimpleNamespace

    from triton import knobs

    from metainfer.engine import slow_launch

    llm = _llm()
    assert slow_launch.install() and slow_launch.install()  # once; a second call keeps the one hook
    monkeypatch.setattr(type(llm.engine), "SLOW_LAUNCH_S", 0.0)
    compile_hook = knobs.runtime.jit_post_compile_hook
    slow_launch._record("before_the_launch")  # taken (cleared) as the launch starts
    launch = llm.engine.runner.launch

    def compiling_launch(batch):
        for name in ("_gdn_decode_kernel", "_skinny_kernel", "_gdn_decode_kernel"):
            compile_hook(key=(), repr=f"{name}[num_warps=4]", fn=SimpleNamespace(name=name), compile={},
                         is_manual_warmup=False, already_compiled=False)
        return launch(batch)

    llm.engine.runner.launch = compiling_launch
    with caplog.at_level("DEBUG", logger="metainfer.engine"):  # the CPU logs it at debug level
        llm.generate(prompt_token_ids=token_prompts([7]), sampling_params=SamplingParams(max_tokens=1))
    assert "Triton compiled: _gdn_decode_kernel x2, _skinny_kernel" in caplog.text
    assert "before_the_launch" not in caplog.text and slow_launch.take() == []
    assert slow_launch.summary(["a"] * 3 + [f"k{i}" for i in range(9)], limit=2) == "a x3, k0, +8 more"


def test_a_failing_warmup_is_logged_not_raised(caplog, monkeypatch):
    llm = _llm()
    r = llm.engine.runner

    def boom():
        raise RuntimeError("compile failed")

    monkeypatch.setattr(r, "warmup", boom)
    with caplog.at_level("ERROR", logger="metainfer.engine"):
        assert r._start_warmup() == 0.0
    assert "warmup failed" in caplog.text


def _variant(q: list[int], c: list[int]) -> tuple:
    """A coarse model of what picks a kernel variant in an eager step: Triton specialises integer
    arguments on == 1 and % 16 (token count, sequence count, decode count, longest chunk, prompt
    count), the grouped-MoE tile bucket, and whether a prompt continues (context > 0)."""
    def spec(x: int) -> str:
        return "0" if x == 0 else "1" if x == 1 else "16" if x % 16 == 0 else "n"

    T, rows = sum(q), sum(q) * 9 / 257
    bucket = "small" if T <= 64 else 16 if rows <= 16 else 32 if rows <= 32 else 64 if rows <= 96 else 128
    prompts = [(n, ctx) for n, ctx in zip(q, c) if n > 1]
    return (spec(T), spec(len(q)), spec(len(q) - len(prompts)), spec(max(q)), spec(len(prompts)), bucket,
            any(ctx > 0 for _, ctx in prompts))


@pytest.mark.parametrize("early", [0, 1])
def test_warmup_covers_a_burst_of_prompts(early):
    """32 prompts at once (the c=32 benchmark, scaled to a 512-token step budget): every eager step
    the scheduler makes (not a lone prompt, not a pure decode: those replay graphs) has a warmup step
    of the same variant key (`_variant`). early=1: the first prompt a step ahead of the other 31, as a
    server sees them; the next step then has 1 decode beside a full budget of prompts, a shape with
    kernel variants of its own (decodes == 1). The H200 server's 2.7 s launch at that step was not this
    (it stayed with the step warmed): see test_eager_steps_use_capacity_wide_block_tables. Not covered
    by the warmup: the burst's last step, its total whatever is left (3,185 tokens beside 28 decodes)."""
    llm = LLM(device="cpu", dtype="float32", max_num_batched_tokens=512, max_model_len=512, max_num_seqs=64)
    seen = []
    launch = llm.engine.runner.launch

    def record(batch):
        items = sorted(batch.items, key=lambda it: it[1] != 1)
        seen.append(([n for _, n in items], [r.num_computed_tokens for r, _ in items]))
        return launch(batch)

    llm.engine.runner.launch = record
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompts = token_prompts([128] * 32, seed=4)
    for p in prompts[:early]:
        llm.engine.add_request(p, sp)
    if early:
        llm.engine.step()
    llm.generate(prompt_token_ids=prompts[early:], sampling_params=sp)
    eager = [(q, c) for q, c in seen if len(q) > 1 and any(n > 1 for n in q)]
    assert len(eager) >= 4
    if early:
        assert eager[0][0] == [1] + [128] * 3 + [127]  # the first prompt's decode beside a full budget
        eager = eager[:1]
    covered = {_variant(q, c) for q, c in warmup_steps(llm.engine.ecfg)}
    missing = [(len(q), sum(q), q[:3], q[-2:]) for q, c in eager if _variant(q, c) not in covered]
    assert not missing, missing


def test_grouped_gate_up_keeps_one_variant_for_every_token_count():
    """The grouped gate/up's scales stride (n_xs: the step's token count, or act_rows of it) is not
    specialised on % 16, so a serving step of any length reuses the variant the warmup compiled
    (a 3,185-token step compiled its own: 0.6 s on the H200, results/2026-12-04h)."""
    pytest.importorskip("triton")
    from metainfer.kernels import moe_grouped

    k = moe_grouped._grouped_gate_up_kernel
    if hasattr(k, "params"):  # a JITFunction (a CUDA machine)
        unspecialised = [p.name for p in k.params if p.do_not_specialize]
    else:  # the interpreter's wrapper keeps the decorator's arguments
        unspecialised = k.kwargs["do_not_specialize"]
    assert "n_xs" in unspecialised
