"""Building the pair under judgement: the engine, and the reference on the same weights.

Dummy weights are materialised once, by the engine, and handed to the reference as views (no copy).
FP8: the engine builds BF16 weights and quantises them; `keep_prequant_weights` records views of
the BF16 tensors just before the quantiser replaces them, so the reference keeps the BF16 originals
(70 GB BF16 + 35 GB FP8 fit one H200). This needs the quantiser to rebind parameters to new tensors,
never to write into the BF16 storage; a fingerprint taken before and checked after enforces it.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from metainfer.oracle.reference import Reference
from metainfer.oracle.suites import Suite, build_suite

LOAD_HEADROOM = 16 << 30  # free GPU memory a second copy of a checkpoint must leave


class OracleSetupError(ValueError):
    """The requested verification cannot run on this build or machine (a usage error, exit 2)."""


@dataclass(frozen=True)
class Setup:
    llm: Any  # metainfer.llm.LLM
    reference: Reference
    suite: Suite
    precision: str  # float32 | bfloat16 | fp8: selects the gates
    notes: list[str] = field(default_factory=list)

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
            },
            "reference": self.reference.info.to_dict(),
            "env": environment(str(runner.device)),
            "notes": list(self.notes),
        }


def fp8_available() -> bool:
    return importlib.util.find_spec("metainfer.model.fp8") is not None


def _fingerprint(weights: dict[str, torch.Tensor]) -> dict[str, float]:
    names = sorted(weights)
    picks = {
        names[0],
        names[len(names) // 2],
        names[-1],
        *[n for n in names if n.endswith("experts.down_proj")][:1],
    }
    return {n: float(weights[n].reshape(-1)[:65536].double().sum()) for n in picks}


@contextmanager
def keep_prequant_weights() -> Iterator[dict]:
    """While active, `metainfer.model.fp8.quantize_model_fp8` first records canonical-named views of
    the weights it is about to quantise (box["weights"]) and their fingerprint."""
    import metainfer.model.fp8 as fp8
    from metainfer.model.weights import hf_state_dict

    box: dict = {}
    original = fp8.quantize_model_fp8

    def recording(model, *args, **kwargs):
        box["weights"] = hf_state_dict(model)
        box["fingerprint"] = _fingerprint(box["weights"])
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
    and a KV cache sized to the suite (not to free memory, which the reference needs)."""
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
    return out


def build_setup(
    model: str, suite_name: str, engine_kwargs: dict, seed: int = 0, reference: str = "auto"
) -> Setup:
    """The engine (`metainfer.llm.LLM`) and its reference for `model` (a HF dir, dummy:CONFIG, or ""
    for the embedded default). `reference`: auto | shared | checkpoint (a HF dir only)."""
    from metainfer.engine.runner import ModelSource
    from metainfer.llm import LLM
    from metainfer.model.weights import hf_state_dict
    from metainfer.tokenizer import load_tokenizer

    kw = dict(engine_kwargs)
    quant = kw.get("quantization")
    if quant == "fp8" and not fp8_available():
        raise OracleSetupError("FP8 verification needs metainfer.model.fp8, which this build lacks")
    if kw.get("dtype") == "float16":
        raise OracleSetupError("verify judges bfloat16, float32 and fp8 engines; float16 has no gates")
    try:
        source = ModelSource.parse(model, kw.get("load_format", "auto"))
    except FileNotFoundError as e:
        raise OracleSetupError(str(e)) from None
    text = _raw_text_config(source.config_path)
    max_pos = int(text.get("max_position_embeddings", 262144))
    cap = min(max_pos, int(kw["max_model_len"])) if kw.get("max_model_len") else max_pos
    tokenizer = load_tokenizer(kw.get("tokenizer") or source.config_path.parent)
    suite = build_suite(suite_name, int(text["vocab_size"]), tokenizer, seed=seed, max_model_len=cap)
    kw = engine_defaults(suite, kw, max_pos)

    recorder = keep_prequant_weights() if quant == "fp8" else nullcontext(None)
    with recorder as box:
        llm = LLM(model=model, **kw)
    runner = llm.engine.runner
    notes: list[str] = []
    precision = "fp8" if quant == "fp8" else str(runner.dtype).removeprefix("torch.")
    if precision not in ("fp8", "float32", "bfloat16"):
        raise OracleSetupError(f"no gates for an engine in {precision}")
    weights = None
    if box is not None:
        if "weights" not in box:
            raise OracleSetupError(
                "the engine did not quantise through metainfer.model.fp8.quantize_model_fp8"
            )
        weights = box.pop("weights")
        if _fingerprint(weights) != box["fingerprint"]:
            raise OracleSetupError("the FP8 quantiser wrote into the BF16 weights the reference needs")
    # a checkpoint is loaded again by transformers when asked, or (auto, BF16/fp32) when it fits;
    # an FP8 engine already holds the BF16 tensors it was quantised from, so auto uses those
    use_ckpt = source.weights_dir is not None and (
        reference == "checkpoint" or (reference == "auto" and weights is None)
    )
    if use_ckpt and reference == "auto" and not _fits_twice(source.weights_dir, runner.device):
        use_ckpt = False
    if source.weights_dir is not None and not use_ckpt:
        notes.append(
            "the reference runs on the tensors the engine loaded from the checkpoint, so the "
            "engine's loader is not independently checked (--reference checkpoint loads it again)"
        )
    if use_ckpt:
        weights = None
        ref = Reference.from_pretrained(source.weights_dir, runner.device, runner.dtype)
    else:
        ref = Reference.from_weights(
            source.config_path, weights if weights is not None else hf_state_dict(runner.model)
        )
    if precision == "fp8" and weights is not None:
        notes.append("FP8 engine judged against the BF16 (pre-quantisation) weights it was quantised from")
    return Setup(llm, ref, suite, precision, notes)


def _fits_twice(weights_dir: Path, device: torch.device) -> bool:
    if device.type != "cuda":
        return True
    size = sum(f.stat().st_size for f in Path(weights_dir).glob("*.safetensors"))
    free, _ = torch.cuda.mem_get_info(device)
    return size + LOAD_HEADROOM < free
