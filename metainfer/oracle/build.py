"""Building the pair under judgement: the engine, and the reference on the weights it should have.

Dummy weights: the reference regenerates them from the seeded recipe (metainfer.oracle.recipe) on
the device, independently of the engine ("independent"); where a second copy does not fit, each
recipe tensor is regenerated, digested and freed, the reference runs on the engine's tensors, and
those are checked against the recipe's digests ("shared-digest"). Checkpoints: transformers loads
the directory itself ("checkpoint"), or, when that does not fit or is not asked for, the reference
runs on the engine's tensors ("shared"). FP8: `record_prequant_digests` digests the BF16 tensors
just before `quantize_model_fp8` replaces them; those digests are compared with the reference's. An
FP8 checkpoint ("fp8-checkpoint"): the reference holds its dequantised weights, read by the oracle
(metainfer.oracle.fp8_checkpoint); the engine's e4m3 tensors are compared with the checkpoint's e4m3
bytes, its unquantised ones with the reference's.
`Setup.weights.check()` re-digests every tensor at the end of the run.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from metainfer.oracle.digest import Digester, WeightAudit
from metainfer.oracle.reference import Reference
from metainfer.oracle.suites import Suite, build_suite

LOAD_HEADROOM = 16 << 30  # free GPU memory a second copy of the weights must leave


class OracleSetupError(ValueError):
    """The requested verification cannot run on this build or machine (a usage error, exit 2)."""


@dataclass(frozen=True)
class Setup:
    llm: Any  # metainfer.llm.LLM
    reference: Reference
    suite: Suite
    precision: str  # float32 | bfloat16 | fp8: selects the gates
    notes: list[str] = field(default_factory=list)
    weights: WeightAudit | None = None  # set by build_setup: `weights.check()` after the runs

    def context(self, model: str) -> dict:
        """Engine config, model, reference: what the verdict records besides figures."""
        from dataclasses import asdict

        from metainfer.oracle.report import environment

        runner = self.llm.engine.runner
        ecfg = {k: v for k, v in asdict(self.llm.engine.ecfg).items() if k != "extra"}
        return {
            "model": model or "default",
            "precision": self.precision,
            "engine": {
                **ecfg,
                "resolved_device": str(runner.device),
                "resolved_dtype": str(runner.dtype).removeprefix("torch."),
                "resolved_quantization": runner.quantization,  # an FP8 checkpoint's, unasked
            },
            "reference": self.reference.info.to_dict(),
            "weights": self.weights.describe() if self.weights is not None else None,
            "env": environment(str(runner.device)),
            "notes": list(self.notes),
        }


def fp8_available() -> bool:
    return importlib.util.find_spec("metainfer.model.fp8") is not None


@contextmanager
def record_prequant_digests(digest: Callable[[torch.Tensor], str]) -> Iterator[dict]:
    """While active, `metainfer.model.fp8.quantize_model_fp8` first records `digest` of every
    canonical tensor it is handed (box["digests"]: name -> digest); no tensor is kept alive."""
    import metainfer.model.fp8 as fp8
    from metainfer.model.weights import hf_state_dict

    box: dict = {}
    original = fp8.quantize_model_fp8

    def recording(model, *args, **kwargs):
        box["digests"] = {n: digest(t) for n, t in hf_state_dict(model).items()}
        return original(model, *args, **kwargs)

    fp8.quantize_model_fp8 = recording
    try:
        yield box
    finally:
        fp8.quantize_model_fp8 = original


def _raw_text_config(config_path: Path) -> dict:
    raw = json.loads(config_path.read_text())
    return dict(raw.get("text_config", raw))


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def engine_defaults(suite: Suite, kwargs: dict, max_positions: int) -> dict:
    """Fills what the user left unset: the suite's chunk budget, a model length that fits the suite,
    and a KV cache and a prefix-cache snapshot pool sized to the suite (not to free memory, which the
    reference needs: the engine's own default gives the snapshots a share of it)."""
    out = dict(kwargs)
    bs = int(out.get("block_size") or 16)
    if out.get("max_num_batched_tokens") is None:
        out["max_num_batched_tokens"] = suite.chunk_tokens
    if out.get("max_model_len") is None:
        out["max_model_len"] = min(max_positions, _round_up(suite.max_len + 1, bs))
    if out.get("num_kv_blocks") is None:
        per_seq = -(-int(out["max_model_len"]) // bs)
        need = sum(-(-(len(p) + suite.gen_tokens) // bs) + 1 for p in suite.prompts)
        out["num_kv_blocks"] = max(per_seq, need) + per_seq
    out["max_num_seqs"] = max(int(out.get("max_num_seqs") or 0), len(suite.prompts) + 4)
    if out.get("num_snapshot_slots") is None:
        out["num_snapshot_slots"] = out["max_num_seqs"]
    return out


def build_setup(
    model: str, suite_name: str, engine_kwargs: dict, seed: int = 0, reference: str = "auto"
) -> Setup:
    """The engine (`metainfer.llm.LLM`) and its reference for `model` (a HF dir, dummy:CONFIG, or ""
    for the embedded default). `reference`: auto | shared | checkpoint (a HF dir only); for dummy
    models, shared forces the digest-verified shared mode. `seed` seeds the suite; the weights seed
    is engine_kwargs["seed"] (default 0), which the oracle passes to the engine and regenerates."""
    from metainfer.engine.runner import ModelSource
    from metainfer.llm import LLM
    from metainfer.model.quant_config import CheckpointError
    from metainfer.tokenizer import load_tokenizer

    kw = dict(engine_kwargs)
    quant = kw.get("quantization")
    if quant == "fp8" and not fp8_available():
        raise OracleSetupError("FP8 verification needs metainfer.model.fp8, which this build lacks")
    if kw.get("dtype") == "float16":
        raise OracleSetupError("verify judges bfloat16, float32 and fp8 engines; float16 has no gates")
    try:
        source = ModelSource.parse(model, kw.get("load_format", "auto"))
        quant, ckpt_fp8 = source.quantization(quant)  # an FP8 checkpoint (config) makes an FP8 engine
    except (FileNotFoundError, CheckpointError) as e:
        raise OracleSetupError(str(e)) from None
    if quant == "fp8" and reference == "shared":
        raise OracleSetupError("an FP8 engine keeps no BF16 tensors to share: use --reference auto")
    kw["seed"] = weights_seed = int(kw.get("seed") or 0)
    text = _raw_text_config(source.config_path)
    max_pos = int(text.get("max_position_embeddings", 262144))
    cap = min(max_pos, int(kw["max_model_len"])) if kw.get("max_model_len") else max_pos
    tokenizer = load_tokenizer(kw.get("tokenizer") or source.config_path.parent)
    suite = build_suite(suite_name, int(text["vocab_size"]), tokenizer, seed=seed, max_model_len=cap)
    kw = engine_defaults(suite, kw, max_pos)

    digest = Digester()
    online = quant == "fp8" and ckpt_fp8 is None  # quantised by the engine from BF16 weights
    recorder = record_prequant_digests(digest) if online else nullcontext(None)
    with recorder as box:
        llm = LLM(model=model, **kw)
    runner = llm.engine.runner
    precision = "fp8" if quant == "fp8" else str(runner.dtype).removeprefix("torch.")
    if precision not in ("fp8", "float32", "bfloat16"):
        raise OracleSetupError(f"no gates for an engine in {precision}")
    prequant = None
    if box is not None:
        if "digests" not in box:
            raise OracleSetupError(
                "the engine did not quantise through metainfer.model.fp8.quantize_model_fp8"
            )
        prequant = box["digests"]
    pair = _Pair(runner, source.config_path, digest, prequant)
    if ckpt_fp8 is not None:
        nbytes = _fp8_reference_bytes(source.weights_dir, runner.dtype)
        if not _fits(nbytes, runner.device):
            raise OracleSetupError(
                f"the reference of an FP8 checkpoint (its dequantised weights, {nbytes / 2**30:.1f} GiB) "
                "does not fit beside the engine"
            )
        ref, audit, notes = pair.fp8_checkpoint(source.weights_dir)
    elif source.weights_dir is None:
        ref, audit, notes = pair.dummy(weights_seed, shared=reference == "shared")
    else:
        use_ckpt = reference == "checkpoint" or (
            reference == "auto" and _fits(_checkpoint_bytes(source.weights_dir), runner.device)
        )
        if prequant is not None and not use_ckpt:
            raise OracleSetupError(
                "the BF16 reference of an FP8 engine does not fit beside it: "
                f"{_checkpoint_bytes(source.weights_dir) / 2**30:.1f} GiB + headroom"
            )
        ref, audit, notes = pair.checkpoint(source.weights_dir) if use_ckpt else pair.shared()
    if online:
        notes.append("FP8 engine judged against the BF16 (pre-quantisation) weights it was quantised from")
    return Setup(llm, ref, suite, precision, notes, audit)


class _Pair:
    """Builds the reference and the weights audit for one engine (`runner`)."""

    def __init__(
        self, runner: Any, config_path: Path, digest: Digester, prequant: dict[str, str] | None
    ) -> None:
        self.runner, self.config_path, self.digest, self.prequant = runner, config_path, digest, prequant

    def engine_tensors(self) -> dict[str, torch.Tensor]:
        """Canonical-named views of the engine's weights; FP8 scales too (audit-only names)."""
        from metainfer.model.weights import hf_state_dict

        model = self.runner.model
        out = hf_state_dict(model)
        if self.runner.quantization == "fp8":
            from metainfer.model.fp8 import fp8_linears, fp8_moes

            heads = [("lm_head", model.lm_head)] if hasattr(model, "lm_head") else []
            for prefix, lin in [*heads, *fp8_linears(model)]:
                if getattr(lin, "weight_scale_inv", None) is not None:
                    out[f"{prefix}.weight_scale_inv"] = lin.weight_scale_inv
            for i, moe in enumerate(fp8_moes(model)):
                for k in ("w_gate_up_scale", "w_down_scale"):
                    if getattr(moe, k, None) is not None:
                        out[f"moe.{i}.{k}"] = getattr(moe, k)
        return out

    def _engine_expected(self, expected: dict[str, str], cast: dict[str, torch.dtype]) -> tuple[dict, list]:
        """What each engine tensor must digest to at the end, and the names that differ now. FP8:
        converted tensors must keep their post-build digest; the rest is compared with `expected`
        now too (against the pre-quantisation digests for the converted ones)."""
        eng = self.engine_tensors()
        want, bad = {}, []
        for name, t in eng.items():
            if name in expected and (self.prequant is None or t.dtype == self.runner.dtype):
                want[name] = expected[name]
                if self.digest(t, cast.get(name)) != want[name]:
                    bad.append(name)
            else:
                want[name] = self.digest(t)
                if name in expected and self.prequant.get(name) != expected[name]:
                    bad.append(name)
        bad += [n for n in expected if n not in eng]
        return want, bad

    def dummy(self, seed: int, shared: bool) -> tuple[Reference, WeightAudit, list[str]]:
        from metainfer.oracle.recipe import iter_recipe, recipe_spec

        r = self.runner
        spec = recipe_spec(self.config_path)
        expected: dict[str, str] = {}
        fits = _fits(spec.nbytes(r.dtype), r.device)
        if self.prequant is not None and not fits:
            raise OracleSetupError(
                f"the BF16 reference of an FP8 engine does not fit beside it: "
                f"{spec.nbytes(r.dtype) / 2**30:.1f} GiB + headroom"
            )
        if fits and not shared:
            ref = Reference.from_recipe(
                self.config_path, seed, r.device, r.dtype, lambda n, t: expected.update({n: self.digest(t)})
            )
            mode, notes, ref_tensors = "independent", [], ref.tensors
        else:
            for name, t in iter_recipe(spec, seed, r.device, r.dtype):
                expected[name] = self.digest(t)
                del t
            ref = Reference.from_weights(self.config_path, self.engine_tensors())
            mode, ref_tensors = "shared-digest", None
            notes = [
                "the reference runs on the engine's tensors (no room for a second copy); each was "
                "checked against the dummy recipe's digest when built and again at the end"
            ]
        if spec.tied:
            expected["lm_head.weight"] = expected["model.embed_tokens.weight"]
        want, bad = self._engine_expected(expected, {})
        audit = WeightAudit(
            mode,
            seed,
            ref.info.weights,
            expected,
            want,
            self.engine_tensors,
            ref_tensors,
            build_mismatched=bad,
            digest=self.digest,
        )
        return ref, audit, notes

    def checkpoint(self, weights_dir: Path) -> tuple[Reference, WeightAudit, list[str]]:
        """transformers loads the checkpoint itself. Engine and reference tensors of different
        dtypes are compared in the narrower of the two (the engine rounded the checkpoint to its
        dtype; the reference to its own)."""
        r = self.runner
        ref = Reference.from_pretrained(weights_dir, r.device, r.dtype)
        eng = self.engine_tensors()
        expected, cast = {}, {}
        for name, t in ref.tensors().items():
            e = eng.get(name)
            if e is not None and e.dtype != t.dtype and e.dtype.is_floating_point and e.element_size() > 1:
                cast[name] = min(e.dtype, t.dtype, key=lambda d: torch.finfo(d).bits)
            expected[name] = self.digest(t, cast.get(name))
        want, bad = self._engine_expected(expected, cast)
        audit = WeightAudit(
            "checkpoint",
            None,
            "checkpoint",
            expected,
            want,
            self.engine_tensors,
            ref.tensors,
            cast,
            bad,
            self.digest,
        )
        return ref, audit, []

    def fp8_checkpoint(self, weights_dir: Path) -> tuple[Reference, WeightAudit, list[str]]:
        """The reference on the checkpoint's dequantised weights. The engine's e4m3 tensors must hold
        the checkpoint's e4m3 bytes (under the same name; stacked experts likewise), its unquantised
        tensors the reference's values; the scales and the parts the engine quantised itself (stored
        unquantised, e.g. in_proj_a/b) are checked for stability only and judged by the logits."""
        r = self.runner
        stored: dict[str, str] = {}
        ref = Reference.from_fp8_checkpoint(
            weights_dir, r.device, r.dtype, lambda n, t: stored.update({n: self.digest(t)})
        )
        expected = self.digest.many(ref.tensors())
        want, bad = {}, []
        for name, t in self.engine_tensors().items():
            want[name] = self.digest(t)
            if t.dtype == torch.float8_e4m3fn:
                if name in stored and stored[name] != want[name]:
                    bad.append(name)
            elif name in expected and expected[name] != want[name]:
                bad.append(name)
        bad += [n for n in expected if n not in want]
        audit = WeightAudit(
            "fp8-checkpoint", None, "checkpoint-dequantised", expected, want, self.engine_tensors,
            ref.tensors, build_mismatched=bad, digest=self.digest,
        )
        note = (
            "the reference was built from the dequantised FP8 checkpoint (e4m3 weight x weight_scale_inv "
            f"per 128 x 128 block, read by the oracle); {len(stored)} e4m3 tensors compared byte for byte "
            "with the engine's"
        )
        return ref, audit, [note]

    def shared(self) -> tuple[Reference, WeightAudit, list[str]]:
        """The reference runs on the engine's loaded tensors: only their stability is checked."""
        eng = self.engine_tensors()
        ref = Reference.from_weights(self.config_path, eng)
        expected = self.digest.many(eng)
        audit = WeightAudit(
            "shared", None, "shared", expected, dict(expected), self.engine_tensors, digest=self.digest
        )
        note = (
            "the reference runs on the tensors the engine loaded from the checkpoint, so the "
            "engine's loader is not independently checked (--reference checkpoint loads it again)"
        )
        return ref, audit, [note]


def _fp8_reference_bytes(weights_dir: Path, dtype: torch.dtype) -> int:
    from metainfer.oracle.fp8_checkpoint import reference_bytes

    return reference_bytes(Path(weights_dir), dtype)


def _checkpoint_bytes(weights_dir: Path) -> int:
    return sum(f.stat().st_size for f in Path(weights_dir).glob("*.safetensors"))


def _fits(nbytes: int, device: torch.device) -> bool:
    """Whether a second copy of `nbytes` fits on `device` with LOAD_HEADROOM to spare (the CPU:
    always). Counts the free memory and what torch's allocator holds unused."""
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return nbytes + LOAD_HEADROOM < free
