"""Train the embedded default SAM 3-architecture model on synthetic coloured-shape scenes (CPU, seeded).

    python scripts/train_default_sam.py [--minutes M] [--out metainfer/assets/sam_default]

Every part of the architecture is present at a small size (168² input, 12×12 patches, windowed + global
ViT layers, CLIP text encoder, fusion encoder, DETR decoder with a presence token, pixel decoder at 48²).
Each step: a batch of scenes, two prompts per scene (a present concept, or an absent one), Hungarian
matching of queries to instances, then focal-free BCE on query logits and presence, L1 on boxes, BCE +
dice on masks. Ends with the held-out evaluation (mean IoU of matched instances, exact instance count).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from scipy.optimize import linear_sum_assignment

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from metainfer.sam.config import SamConfig  # noqa: E402
from metainfer.sam.evaluate import evaluate, sample_prompts, scene_with_repeats  # noqa: E402
from metainfer.sam.model import SamModel  # noqa: E402
from metainfer.sam.processing import preprocess  # noqa: E402
from metainfer.sam.scenes import all_prompts, targets  # noqa: E402
from metainfer.sam.tokenizer import PromptTokenizer, train_tokenizer  # noqa: E402
from metainfer.sam.weights import init_buffers, save_checkpoint  # noqa: E402

SIZE = 168


def default_config(vocab_size: int) -> SamConfig:
    return SamConfig(
        vision_hidden=64, vision_intermediate=128, vision_layers=4, vision_heads=4, image_size=SIZE,
        patch_size=14, window_size=6, global_layers=(1, 3), pretrain_image_size=84, fpn_hidden=32,
        vocab_size=vocab_size, text_hidden=64, text_intermediate=128, text_layers=2, text_heads=4,
        text_context=16, text_projection_dim=64, bos_token_id=0, eos_token_id=1,
        hidden=32, heads=4, intermediate=64, encoder_layers=2, decoder_layers=2, num_queries=8, mask_heads=4,
    )  # fmt: skip


def box_of(mask: np.ndarray) -> np.ndarray:
    ys, xs = np.nonzero(mask)
    return np.array([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1], dtype=np.float32) / SIZE


def make_batch(rng: np.random.Generator, tok: PromptTokenizer, n_images: int, mask_side: int):
    scenes = [scene_with_repeats(rng, SIZE) for _ in range(n_images)]
    pixels = torch.stack([preprocess(s.image, SIZE) for s in scenes])
    prompts, index, tgt_masks, tgt_boxes = [], [], [], []
    for i, s in enumerate(scenes):
        for p in sample_prompts(s, rng):
            ms = targets(s, p)
            prompts.append(p)
            index.append(i)
            if ms:
                t = torch.from_numpy(np.stack(ms)).float()[:, None]
                tgt_masks.append(F.interpolate(t, size=(mask_side, mask_side), mode="area")[:, 0])
                tgt_boxes.append(torch.from_numpy(np.stack([box_of(m) for m in ms])))
            else:
                tgt_masks.append(torch.zeros(0, mask_side, mask_side))
                tgt_boxes.append(torch.zeros(0, 4))
    ids, valid = tok.encode(prompts)
    return pixels, ids, valid, torch.tensor(index), tgt_masks, tgt_boxes


def dice_cost(pred: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    """pred [Q, M] probabilities, tgt [N, M] -> [Q, N] dice loss."""
    num = 2 * pred @ tgt.T
    den = pred.sum(-1)[:, None] + tgt.sum(-1)[None, :]
    return 1 - (num + 1) / (den + 1)


def losses(out, tgt_masks, tgt_boxes):
    total = {"cls": 0.0, "presence": 0.0, "box": 0.0, "mask": 0.0, "dice": 0.0}
    p_count = out.logits.shape[0]
    n_matched = 0
    for p in range(p_count):
        logits, masks, boxes = out.logits[p], out.masks[p], out.boxes[p]
        tm, tb = tgt_masks[p], tgt_boxes[p]
        n = tm.shape[0]
        label = torch.zeros_like(logits)
        if n:
            with torch.no_grad():
                prob = masks.flatten(1).sigmoid()
                cost = (
                    2 * dice_cost(prob, tm.flatten(1))
                    + 5 * torch.cdist(boxes, tb, p=1)
                    - 2 * logits.sigmoid()[:, None]
                )
                qi, ti = linear_sum_assignment(cost.numpy())
            qi, ti = torch.as_tensor(qi), torch.as_tensor(ti)
            label[qi] = 1.0
            total["box"] = total["box"] + F.l1_loss(boxes[qi], tb[ti], reduction="sum")
            pm, tmm = masks[qi], tm[ti]
            total["mask"] = (
                total["mask"]
                + F.binary_cross_entropy_with_logits(pm, tmm, reduction="none").mean((1, 2)).sum()
            )
            total["dice"] = (
                total["dice"] + dice_cost(pm.flatten(1).sigmoid(), tmm.flatten(1)).diagonal().sum()
            )
            n_matched += n
        total["cls"] = total["cls"] + F.binary_cross_entropy_with_logits(logits, label, reduction="sum")
        pres = torch.tensor([1.0 if n else 0.0])
        total["presence"] = total["presence"] + F.binary_cross_entropy_with_logits(
            out.presence_logits[p], pres
        )
    m = max(n_matched, 1)
    return {
        "cls": total["cls"] / p_count,
        "presence": total["presence"] / p_count,
        "box": total["box"] / m,
        "mask": total["mask"] / m,
        "dice": total["dice"] / m,
    }


def init_model(config: SamConfig, seed: int) -> SamModel:
    torch.manual_seed(seed)
    model = SamModel(config)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            torch.nn.init.zeros_(p)
        elif p.ndim == 1:
            torch.nn.init.ones_(p)
        elif name.endswith("reference_points.weight"):
            torch.nn.init.uniform_(p, -1.5, 1.5)
        elif "embed" in name or "presence_token" in name:
            torch.nn.init.normal_(p, std=0.5 if "query_embed" in name or "presence" in name else 0.02)
        else:
            torch.nn.init.trunc_normal_(p, std=0.02 if p.ndim == 2 else 1.0 / math.sqrt(p[0].numel()))
    init_buffers(model, "cpu")
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=40.0, help="training time budget")
    ap.add_argument("--steps", type=int, default=20000, help="at most this many steps")
    ap.add_argument("--images", type=int, default=8, help="scenes per step (two prompts each)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: shared cores stall multi-threaded ops)"
    )
    ap.add_argument("--eval-scenes", type=int, default=200)
    ap.add_argument("--new-tokenizer", action="store_true", help="train the tokenizer even if --out has one")
    ap.add_argument("--out", default=str(ROOT / "metainfer" / "assets" / "sam_default"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # the `tokenizers` BPE trainer breaks frequency ties in no fixed order: an existing tokenizer.json is
    # reused so that a rerun with the same seed trains the same model
    if (out / "tokenizer.json").is_file() and not args.new_tokenizer:
        from tokenizers import Tokenizer

        hf_tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    else:
        hf_tok = train_tokenizer(all_prompts(), 512)
        hf_tok.save(str(out / "tokenizer.json"))
    config = default_config(hf_tok.get_vocab_size())
    tok = PromptTokenizer(hf_tok, config.text_context)
    model = init_model(config, args.seed)
    print(f"parameters: {sum(p.numel() for p in model.parameters()):,}", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    rng = np.random.default_rng(args.seed)
    weights = {"cls": 2.0, "presence": 1.0, "box": 5.0, "mask": 2.0, "dice": 2.0}
    t0, step, budget = time.time(), 0, args.minutes * 60
    model.train()
    while step < args.steps and time.time() - t0 < budget:
        frac = (time.time() - t0) / budget
        lr = args.lr * min(1.0, (step + 1) / 200) * (0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        for g in opt.param_groups:
            g["lr"] = lr
        pixels, ids, valid, index, tm, tb = make_batch(rng, tok, args.images, config.mask_size)
        o = model(pixels, ids, valid, index)
        parts = losses(o, tm, tb)
        loss = sum(weights[k] * v for k, v in parts.items())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 50 == 0:
            desc = " ".join(f"{k} {float(v.detach()):.3f}" for k, v in parts.items())
            print(
                f"step {step} {time.time() - t0:.0f}s lr {lr:.2e} loss {loss.item():.3f} ({desc})", flush=True
            )
        if step % 500 == 0:
            save_checkpoint(model, out, torch.bfloat16)
            print(
                f"eval at step {step}: {json.dumps(evaluate(model, tok, args.seed + 20_000, 40, SIZE))}",
                flush=True,
            )
    save_checkpoint(model, out, torch.bfloat16)  # bf16 weights: half the bytes, the same held-out figures
    with torch.no_grad():  # the evaluation sees the weights as shipped
        for t in model.state_dict().values():
            if t.is_floating_point():
                t.copy_(t.bfloat16())
    result = evaluate(model, tok, args.seed + 10_000, args.eval_scenes, SIZE)
    result.update(steps=step, minutes=round((time.time() - t0) / 60, 1), seed=args.seed)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
