"""The model runner: owns the model and every device tensor; turns a ScheduledBatch into tokens."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from metainfer.config import DEFAULT_MODEL_DIR, EngineConfig, ModelConfig
from metainfer.engine import grammar
from metainfer.engine.cuda_graph import DecodeGraphs
from metainfer.engine.executors import (
    DecodeExecutor,
    EagerExecutor,
    Executor,
    PrefillExecutor,
    StepInputs,
)
from metainfer.engine.prefill_graph import PrefillGraphs
from metainfer.engine.request import Request, TokenLogprob
from metainfer.engine.sampler import SamplingBatch, sample, top_logprobs
from metainfer.engine.scheduler import ScheduledBatch
from metainfer.engine.warmup import run_warmup, warmup_steps
from metainfer.forward_meta import CacheTensors
from metainfer.kernels import ops
from metainfer.model.quant_config import Fp8Scheme, read_scheme, resolve_quantization
from metainfer.model.qwen3_5_moe import Qwen3_5MoeModel
from metainfer.model.weights import build_model, init_dummy, load_checkpoint

log = logging.getLogger("metainfer.engine")
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
CPU_CACHE_BYTES = 1 << 30  # default KV budget on the CPU
# prefix caching, num_snapshot_slots None: the share of the CUDA cache (KV blocks + state snapshots,
# sized from free memory, or from num_kv_blocks where that is given) that snapshots get; on the CPU
# SNAPSHOTS_PER_SEQ per max_num_seqs within a quarter of CPU_CACHE_BYTES
SNAPSHOT_SHARE = 0.25
SNAPSHOTS_PER_SEQ = 4


@dataclass(frozen=True)
class ModelSource:
    """Where weights come from: a directory with safetensors, or a config with seeded dummy init."""

    config_path: Path
    weights_dir: Path | None  # None: dummy weights
    label: str

    @classmethod
    def parse(cls, model: str, load_format: str = "auto") -> ModelSource:
        if not model:
            return cls(
                DEFAULT_MODEL_DIR / "config.json", _weights_dir(DEFAULT_MODEL_DIR, load_format), "default"
            )
        if model.startswith("dummy:"):
            p = Path(model[len("dummy:") :]).expanduser()
            cfg = p / "config.json" if p.is_dir() else p
            if not cfg.is_file():
                raise FileNotFoundError(f"dummy model config not found: {cfg}")
            return cls(cfg, None, model)
        d = Path(model).expanduser()
        if not d.is_dir():
            raise FileNotFoundError(f"model directory not found: {d}")
        return cls(d / "config.json", _weights_dir(d, load_format), str(d))

    def quantization(self, requested: str | None) -> tuple[str | None, Fp8Scheme | None]:
        """The engine's weight quantization ("fp8" or None) for EngineConfig.quantization `requested`,
        and the FP8 scheme of the checkpoint to load (None: no checkpoint, or not FP8): a config
        declaring FP8 gives FP8 without asking (`quant_config.resolve_quantization`); CheckpointError
        for a quantization_config the engine cannot load or an FP8 checkpoint asked for unquantised."""
        scheme = read_scheme(self.config_path)
        quant = resolve_quantization(requested, scheme, self.weights_dir)
        return quant, scheme if self.weights_dir is not None else None


def _weights_dir(d: Path, load_format: str) -> Path | None:
    if load_format == "dummy":
        return None
    has = any(d.glob("*.safetensors"))
    if load_format == "safetensors" and not has:
        raise FileNotFoundError(f"no *.safetensors in {d}")
    return d if has else None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError("CUDA was requested but is not available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


StateCopy = tuple[torch.Tensor, torch.Tensor]  # one slot's DeltaNet conv and recurrent states, [layer, ...]


@dataclass
class InFlight:
    """A launched step. `samples`: the requests that sample a token, with the index that token
    takes in their `output_token_ids`; the tokens arrive in `host` once `event` has fired."""

    items: list[tuple[Request, int]]
    samples: list[tuple[Request, int]] = field(default_factory=list)
    host: torch.Tensor | None = None  # [R] int64 (pinned on CUDA)
    event: torch.cuda.Event | None = None
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    score_logits: dict[str, torch.Tensor] = field(default_factory=dict)
    # speculative verify (synchronous): request id -> the greedy token after the last real token and
    # after each draft, and its DeltaNet states from before the step (to restore on a rejection)
    verify: dict[str, list[int]] = field(default_factory=dict)
    saved_states: dict[str, StateCopy] = field(default_factory=dict)
    path: str = "eager"  # which launch path ran it: decode_graph | prefill_graph | eager


class ModelRunner:
    def __init__(
        self, ecfg: EngineConfig, model_cfg: ModelConfig, source: ModelSource, progress: bool = True
    ) -> None:
        self.ecfg, self.cfg = ecfg, model_cfg
        self.device = resolve_device(ecfg.device)
        self.dtype = resolve_dtype(ecfg.dtype, self.device)
        self.ssm_dtype = getattr(torch, ecfg.ssm_state_dtype)  # DeltaNet recurrent states' storage
        torch.manual_seed(ecfg.seed)
        # "fp8" or None; an FP8 checkpoint's e4m3 tensors are allocated and loaded as such
        self.quantization, ckpt_fp8 = source.quantization(ecfg.quantization)
        self.model: Qwen3_5MoeModel = build_model(model_cfg, self.dtype, self.device,
                                                  fp8=ckpt_fp8 is not None)
        if source.weights_dir is None:
            init_dummy(self.model, ecfg.seed)
        else:
            load_checkpoint(self.model, source.weights_dir, progress=progress, fp8=ckpt_fp8)
        if self.quantization == "fp8":
            from metainfer.model.fp8 import quantize_model_fp8

            quantize_model_fp8(self.model, lm_head=True if ecfg.fp8_lm_head else None)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.num_slots = ecfg.num_state_slots or ecfg.max_num_seqs
        self.num_snapshots = self._num_snapshot_slots()  # state slots num_slots+1.. (engine.cache)
        self.num_blocks = self._num_kv_blocks()
        self.caches = self._allocate_caches()
        self.mtp = None  # speculative="mtp": the drafter, fed every step's hidden rows (`_note_hidden`)
        self._hidden: torch.Tensor | None = None  # the step's final hidden states (the MTP drafter's input)
        if ecfg.speculative == "mtp":
            from metainfer.spec.mtp import MTPDrafter

            self.mtp = MTPDrafter(self.model, self.caches, ecfg.block_size, self.device,
                                  draft_vocab=ecfg.speculative_draft_vocab, max_blocks=self.blocks_per_seq)
        # test/oracle seam: called with (owners, logits [R, V]) every step that computes logits
        self.logits_hook = None
        self._tok_buf = torch.zeros(max(ecfg.max_num_seqs, 1), dtype=torch.int64, device=self.device)
        self._prev_rows: dict[str, int] = {}  # request id -> row of _tok_buf (last launched step)
        self.decode = self._decode_path()
        self.prefill = self._prefill_path()
        self.executors: list[Executor] = [  # tried in this order
            *([DecodeExecutor(self.decode, ecfg.block_size)] if self.decode is not None else []),
            *([PrefillExecutor(self.prefill)] if self.prefill is not None else []),
            EagerExecutor(self.model, self.caches, self._tok_buf, ecfg.block_size, self.blocks_per_seq,
                          self.device),
        ]
        if self.mtp is not None and self.prefill is not None:  # a proposal in one replay (spec.mtp)
            from metainfer.spec.mtp import MTPGraphs

            g = MTPGraphs(self.model, self.caches, ecfg.num_speculative_tokens, self.blocks_per_seq,
                          ecfg.block_size, self.device, use_graphs=self.prefill.use_graphs,
                          logits=self.mtp.logits)
            g.capture()
            self.mtp.graphs = g
        self.warmup_s = self._start_warmup() if self.device.type == "cuda" and ecfg.warmup else 0.0

    def recapture_decode(self) -> None:
        """The decode graphs captured again (`DecodeGraphs.recapture`): settings the decode kernels read at
        capture (`metainfer.settings`, e.g. inside `settings.override`) take their current values. The
        prefill and MTP graphs stay as they are. With no request running only."""
        self._hidden = None
        if self.decode is not None:
            self.decode.recapture()

    def _decode_path(self) -> DecodeGraphs | None:
        """Persistent-buffer decode (CUDA graphs when the decode kernels are all present)."""
        if self.ecfg.extra.get("no_decode_buffers"):
            return None
        if self.device.type == "cuda" and not self.ecfg.extra.get("no_kernels"):
            ops.use_kernels(True)
        graphable = ops.kernels_enabled() and all(
            ops.has_kernel(k)
            for k in ("paged_attention", "moe_experts", "gdn_decode", "causal_conv1d_update")
        )
        dg = DecodeGraphs(
            self.model,
            self.caches,
            self.ecfg.max_num_seqs,
            self.blocks_per_seq,
            self.num_slots,
            self.device,
            use_graphs=graphable and not self.ecfg.enforce_eager,
            tok_buf=self._tok_buf,
        )
        dg.capture()
        return dg

    def _prefill_path(self) -> PrefillGraphs | None:
        """CUDA graphs for a lone prefill at the configured step sizes (where decode graphs run)."""
        auto_off = self.ecfg.prefill_graphs is None and self.device.type != "cuda"  # no padding on CPU
        sizes = () if auto_off else self.ecfg.prefill_graph_sizes
        if not sizes or self.decode is None or (self.device.type == "cuda" and not self.decode.use_graphs):
            return None
        rows = 1 + (self.ecfg.num_speculative_tokens if self.ecfg.speculative else 0)
        pg = PrefillGraphs(self.model, self.caches, sizes, self.blocks_per_seq, self.ecfg.block_size,
                           self.device, logits_rows=rows)
        pg.capture()
        return pg

    def _start_warmup(self) -> float:
        """The warmup at start: an optimisation, so a Python-level failure is logged, not raised
        (a step of that shape would then fail its own requests, never the server's start)."""
        try:
            return self.warmup()
        except Exception:
            log.exception("warmup failed; serving without it (the first busy steps may compile kernels)")
            return 0.0

    def warmup(self) -> float:
        """Eager steps of serving's shapes (`engine.warmup`): the JIT compiles happen now. -> seconds."""
        steps = warmup_steps(self.ecfg)
        return run_warmup(
            self.model, self.caches, steps, self.ecfg.block_size, self.blocks_per_seq, self.device
        )

    # ---- cache sizing -------------------------------------------------------------------------
    @property
    def blocks_per_seq(self) -> int:
        """KV blocks one sequence of max_model_len tokens needs (a block table's width)."""
        return -(-self.ecfg.max_model_len // self.ecfg.block_size)

    @property
    def num_kv_layers(self) -> int:
        """Full-attention KV caches: one per full-attention layer, plus the MTP layer's when it drafts."""
        return len(self.cfg.full_layer_ids) + int(self.ecfg.speculative == "mtp")

    def _bytes_per_block(self) -> int:
        c = self.cfg
        elt = torch.finfo(self.dtype).bits // 8
        return self.num_kv_layers * 2 * self.ecfg.block_size * c.num_key_value_heads * c.head_dim * elt

    def _bytes_per_slot(self) -> int:
        c = self.cfg
        elt = torch.finfo(self.dtype).bits // 8
        conv = (c.linear_conv_kernel_dim - 1) * c.linear_conv_dim * elt
        ssm_elt = torch.finfo(self.ssm_dtype).bits // 8
        ssm = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * ssm_elt
        return len(c.linear_layer_ids) * (conv + ssm)

    def _cuda_cache_budget(self) -> float:
        """Bytes for KV blocks and state snapshots: free memory after the reserve, activations and
        the running state slots."""
        e = self.ecfg
        free, total = torch.cuda.mem_get_info(self.device)
        reserve = (1 - e.gpu_memory_utilization) * total
        act = max(2 << 30, 3 * e.max_num_batched_tokens * self.cfg.vocab_size * 4)
        return free - reserve - act - (self.num_slots + 1) * self._bytes_per_slot()

    def _num_snapshot_slots(self) -> int:
        e = self.ecfg
        if not e.enable_prefix_caching:
            return 0
        if e.num_snapshot_slots is not None:
            return e.num_snapshot_slots
        if self.device.type != "cuda":
            return min(SNAPSHOTS_PER_SEQ * e.max_num_seqs, CPU_CACHE_BYTES // 4 // self._bytes_per_slot())
        if e.num_kv_blocks is not None:  # the same share of a cache whose KV part is given
            kv = e.num_kv_blocks * self._bytes_per_block()
            return int(SNAPSHOT_SHARE / (1 - SNAPSHOT_SHARE) * kv // self._bytes_per_slot())
        return max(0, int(SNAPSHOT_SHARE * self._cuda_cache_budget() // self._bytes_per_slot()))

    def _num_kv_blocks(self) -> int:
        e = self.ecfg
        per_seq = self.blocks_per_seq
        if e.num_kv_blocks is not None:
            n = e.num_kv_blocks
        elif self.device.type == "cuda":
            budget = self._cuda_cache_budget() - self.num_snapshots * self._bytes_per_slot()
            n = int(budget // self._bytes_per_block())
            n = min(n, e.max_num_seqs * per_seq)
        else:
            n = min(e.max_num_seqs * per_seq, CPU_CACHE_BYTES // max(1, self._bytes_per_block()))
        if n < per_seq:
            raise ValueError(
                f"KV cache of {n} blocks x {e.block_size} tokens cannot hold one sequence of "
                f"max_model_len={e.max_model_len}; lower max_model_len or raise the cache size"
            )
        return n

    def _allocate_caches(self) -> CacheTensors:
        """KV blocks per full-attention layer; the DeltaNet states of every layer in one tensor each
        ([layer, slot, ...]: a slot's states over all layers are one strided view, so a verify's
        snapshot and restore are one copy each, not one per layer), handed to the model as per-layer
        views."""
        c, dev, dt = self.cfg, self.device, self.dtype
        nb, bs = self.num_blocks + 1, self.ecfg.block_size  # +1: block 0 is the null block
        ns = self.num_slots + self.num_snapshots + 1
        kv_shape = (nb, bs, c.num_key_value_heads, c.head_dim)
        n_full, n_lin = self.num_kv_layers, len(c.linear_layer_ids)
        conv_shape = (n_lin, ns, c.linear_conv_kernel_dim - 1, c.linear_conv_dim)
        self.conv_states = torch.zeros(conv_shape, dtype=dt, device=dev)
        hv, dk, dv = c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        self.ssm_states = torch.zeros(n_lin, ns, hv, dk, dv, dtype=self.ssm_dtype, device=dev)
        return CacheTensors(
            k=[torch.zeros(kv_shape, dtype=dt, device=dev) for _ in range(n_full)],
            v=[torch.zeros(kv_shape, dtype=dt, device=dev) for _ in range(n_full)],
            conv=list(self.conv_states.unbind(0)),
            ssm=list(self.ssm_states.unbind(0)),
        )

    # ---- one step -----------------------------------------------------------------------------
    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch) -> InFlight:
        """Enqueues one step: forward, logits, sampling on the device. Returns without waiting for
        the GPU unless the batch asks for host-side extras (logprobs, prompt logprobs, scores).

        A request's last token may still be PENDING (sampled by the previous, unfinished step): its
        id is taken on the device from that step's token buffer."""
        items = sorted(batch.items, key=lambda it: it[1] != 1)  # decodes first (stable)
        self.copy_states(batch.copies.restores)
        saved = {r.request_id: self._save_state(r) for r, _ in items if r.draft_token_ids}
        inputs = StepInputs.build(items, self._prev_rows)
        for ex in self.executors:  # the first that supports the step (the eager one, last, takes any)
            if ex.supports(inputs):
                break
        logits, self._hidden = ex.run(inputs)
        self.copy_states(batch.copies.saves)
        owners = inputs.owners
        argmaxed = ex.argmaxed  # the decode graph's step: _tok_buf[:len(items)] holds the rows' argmax
        inflight = InFlight(items=items, saved_states=saved, path=ex.path)
        if self.mtp is not None:
            self._note_hidden(items)
        self._hidden = None  # (held only until noted: a prefill's rows are large)
        if argmaxed and self._needs_fp32(owners):
            logits = logits.float()  # (the graph's are in the model's dtype)
        if logits is not None:
            if self.logits_hook is not None:
                self.logits_hook(owners, logits)
            self._sample(logits, owners, inflight, argmaxed)
            self._extras(logits, owners, inflight)
            self._verify(logits, owners, inflight)
        self._prev_rows = {r.request_id: j for j, (r, _) in enumerate(inflight.samples)}
        return inflight

    def _note_hidden(self, items: list[tuple[Request, int]]) -> None:
        """Hands the step's final hidden rows to the MTP drafter, per request (positions start..start+n-1)."""
        from metainfer.spec.mtp import MTPState

        base = 0
        for r, n in items:
            if r.num_cached_tokens and r.num_computed_tokens == r.num_cached_tokens:
                # the first step after a prefix hit: MTP rows resume at the hit (the MTP KV below it
                # is the shared blocks', as their writer left it: drafts only, outputs unaffected)
                self.mtp.forget(r)
                r.spec_index = MTPState(done=r.num_cached_tokens, hidden_pos=r.num_cached_tokens)
            self.mtp.note(r, r.num_computed_tokens, self._hidden[base : base + n])
            base += n

    def wait(self, inflight: InFlight) -> list[int]:
        """The sampled tokens of a launched step, in `inflight.samples` order (blocks until ready)."""
        if inflight.event is not None:
            inflight.event.synchronize()
        return inflight.host.tolist() if inflight.host is not None else []

    def copy_states(self, pairs: list[tuple[int, int]]) -> None:
        """DeltaNet conv and recurrent states of every layer from slot src to slot dst, per pair in
        order (device copies queued on the stream: prefix-cache snapshots and their restores)."""
        for src, dst in pairs:
            self.conv_states[:, dst].copy_(self.conv_states[:, src])
            self.ssm_states[:, dst].copy_(self.ssm_states[:, src])

    # ---- speculative verify ---------------------------------------------------------------------
    def _save_state(self, req: Request) -> StateCopy:
        """Copies of the request's DeltaNet conv and recurrent states, all layers (a verify step
        advances them over every draft; a rejection puts these back and the accepted tokens are
        recomputed). Two copies: the slot's view across the stacked layers."""
        slot = req.state_slot
        return self.conv_states[:, slot].clone(), self.ssm_states[:, slot].clone()

    def restore_state(self, req: Request, saved: StateCopy) -> None:
        slot = req.state_slot
        self.conv_states[:, slot].copy_(saved[0])
        self.ssm_states[:, slot].copy_(saved[1])

    def _verify(self, logits: torch.Tensor, owners: list[tuple[Request, str, int]], out: InFlight) -> None:
        """Greedy tokens of the verify rows, in order per request, on the host."""
        idx = [i for i, (_, kind, _) in enumerate(owners) if kind == "verify"]
        if not idx:
            return
        rows = logits if len(idx) == logits.shape[0] else logits[torch.tensor(idx, device=logits.device)]
        toks = rows.argmax(dim=-1).tolist()
        for i, tok in zip(idx, toks):
            out.verify.setdefault(owners[i][0].request_id, []).append(tok)

    def _needs_fp32(self, owners: list[tuple[Request, str, int]]) -> bool:
        """Whether a step's logits are read beyond their argmax: the hook, sampling, logprobs."""
        return self.logits_hook is not None or any(
            kind != "sample" or not r.params.greedy or r.params.logprobs is not None for r, kind, _ in owners
        )

    def _sample(self, logits: torch.Tensor, owners: list[tuple[Request, str, int]], out: InFlight,
                argmaxed: bool = False) -> None:
        """The step's next tokens into _tok_buf[:R] (the next step reads pending tokens there) and,
        non-blocking, to the host. argmaxed: _tok_buf[:R] already holds every row's argmax (the
        decode graph's; logits are its raw rows then, unless a reader needed them in fp32)."""
        rows = [
            i
            for i, (r, kind, p) in enumerate(owners)
            if kind == "sample" or (kind == "prompt" and not r.score_only and p == r.num_tokens - 1)
        ]
        if not rows:
            return
        reqs = [owners[i][0] for i in rows]
        sub = logits if len(rows) == len(owners) else logits[torch.tensor(rows, device=self.device)]
        R = len(reqs)
        raw = sub  # logprobs are the model's, before min_tokens' ban
        banned = self._min_tokens_bans(reqs, sub.shape[-1])
        if banned:
            sub = sub.clone()
            for j, ids in banned:
                sub[j, ids] = float("-inf")
            argmaxed = False
        if any(r.grammar is not None for r in reqs):
            sub = grammar.mask_logits(sub, reqs)  # (only such steps read the mask: they run sync)
            argmaxed = False
        if all(r.params.greedy for r in reqs):
            if not (argmaxed and len(rows) == len(owners)):
                ops.argmax_rows(sub, self._tok_buf)
            toks = self._tok_buf[:R]
        else:
            sb = SamplingBatch.build(
                [
                    (
                        r.params.temperature,
                        max(r.params.top_k, 0),
                        r.params.top_p,
                        r.params.min_p,
                        r.seed,
                        len(r.output_token_ids),
                    )
                    for r in reqs
                ],
                self.device,
            )
            toks = sample(sub, sb)
            self._tok_buf[:R].copy_(toks)
        out.samples = [(r, len(r.output_token_ids)) for r in reqs]
        out.host = torch.empty(R, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        out.host.copy_(toks, non_blocking=True)
        if self.device.type == "cuda":
            out.event = torch.cuda.Event()
            out.event.record()
        if any(r.params.logprobs is not None for r in reqs):
            n_lp = max((r.params.logprobs or 0) for r in reqs)
            chosen, tv, ti = (t.tolist() for t in top_logprobs(raw, toks, n_lp))
            host = toks.tolist()
            for j, r in enumerate(reqs):
                if r.params.logprobs is not None:
                    k = r.params.logprobs
                    out.logprobs[r.request_id] = TokenLogprob(
                        host[j], chosen[j], list(zip(ti[j][:k], tv[j][:k]))
                    )

    @staticmethod
    def _min_tokens_bans(reqs: list[Request], vocab: int) -> list[tuple[int, list[int]]]:
        """(row, ids) for each request still short of its min_tokens: its stop ids and EOS ids (unless
        ignore_eos) may not be sampled yet (vLLM's semantics: they cannot be generated before)."""
        out = []
        for j, r in enumerate(reqs):
            if len(r.output_token_ids) < r.params.min_tokens:
                ids = set(r.params.stop_token_ids) | (set() if r.params.ignore_eos else set(r.eos_token_ids))
                ids = sorted(i for i in ids if 0 <= i < vocab)
                if ids:
                    out.append((j, ids))
        return out

    def _extras(self, logits, owners, out: InFlight) -> None:
        """Prompt logprobs and scoring logits (synchronous)."""
        by_req: dict[str, list[int]] = {}
        for i, (r, kind, _) in enumerate(owners):
            if kind == "prompt":
                by_req.setdefault(r.request_id, []).append(i)
        for rid, idx in by_req.items():
            req = owners[idx[0]][0]
            sub = logits[torch.tensor(idx, device=logits.device)]
            if req.score_only:
                out.score_logits[rid] = sub
                continue
            positions = [owners[i][2] for i in idx]
            nxt = [req.token_at(p + 1) if p + 1 < req.num_prompt_tokens else 0 for p in positions]
            k = req.params.prompt_logprobs or 0
            chosen, tv, ti = (t.tolist() for t in top_logprobs(sub, torch.tensor(nxt, device=sub.device), k))
            out.prompt_logprobs[rid] = [
                TokenLogprob(nxt[j], chosen[j], list(zip(ti[j], tv[j])))
                for j, p in enumerate(positions)
                if p + 1 < req.num_prompt_tokens
            ]
