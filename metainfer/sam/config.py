"""SAM 3 image-model configuration: one frozen dataclass, read from and written to transformers'
`Sam3Config` layout (config.json of a checkpoint directory).

The defaults are the released checkpoint's shape (840 M parameters, 1008² input). Only the image path with
text prompts is described: the geometry (box-prompt) encoder and the video tracker are not part of it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

ACTIVATIONS = ("gelu", "relu", "quick_gelu")


@dataclass(frozen=True)
class SamConfig:
    # vision: ViT with windowed attention except at `global_layers`, 2-D axial RoPE, tiled position table
    vision_hidden: int = 1024
    vision_intermediate: int = 4736
    vision_layers: int = 32
    vision_heads: int = 16
    image_size: int = 1008
    patch_size: int = 14
    window_size: int = 24
    global_layers: tuple[int, ...] = (7, 15, 23, 31)
    pretrain_image_size: int = 336  # the position table covers (pretrain_image_size / patch_size)² patches
    vision_eps: float = 1e-6
    rope_theta: float = 10000.0
    vision_act: str = "gelu"
    # feature pyramid: levels at these scales of the patch grid; the last level is built by the checkpoint
    # but unused by the image path (its weights are loaded and ignored)
    fpn_hidden: int = 256
    scale_factors: tuple[float, ...] = (4.0, 2.0, 1.0, 0.5)
    # text: CLIP text transformer (causal attention), projected to `hidden`
    vocab_size: int = 49408
    text_hidden: int = 1024
    text_intermediate: int = 4096
    text_layers: int = 24
    text_heads: int = 16
    text_context: int = 32
    text_projection_dim: int = 512  # CLIP's own projection: stored in checkpoints, unused here
    text_eps: float = 1e-5
    text_act: str = "gelu"
    bos_token_id: int = 49406
    eos_token_id: int = 49407
    # detector: fusion encoder, DETR decoder with a presence token, pixel decoder
    hidden: int = 256
    heads: int = 8
    intermediate: int = 2048
    encoder_layers: int = 6
    decoder_layers: int = 6
    num_queries: int = 200
    detector_act: str = "relu"
    mask_heads: int = 8
    upsampling_stages: int = 3

    def __post_init__(self) -> None:
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise ValueError(f"SamConfig: {what}")

        object.__setattr__(self, "global_layers", tuple(int(i) for i in self.global_layers))
        object.__setattr__(self, "scale_factors", tuple(float(s) for s in self.scale_factors))
        need(self.image_size % self.patch_size == 0, "image_size must be a multiple of patch_size")
        need(
            self.pretrain_image_size % self.patch_size == 0, "pretrain_image_size must be a multiple of patch"
        )
        need(self.vision_hidden % self.vision_heads == 0, "vision_hidden must divide into vision_heads")
        need(
            (self.vision_hidden // self.vision_heads) % 4 == 0,
            "vision head_dim must be a multiple of 4 (RoPE)",
        )
        need(self.text_hidden % self.text_heads == 0, "text_hidden must divide into text_heads")
        need(
            self.hidden % self.heads == 0 and self.hidden % self.mask_heads == 0,
            "hidden must divide into heads",
        )
        need(self.hidden % 8 == 0, "hidden must be a multiple of 8 (GroupNorm(8) in the pixel decoder)")
        need(self.vision_hidden % 4 == 0, "vision_hidden must be a multiple of 4 (FPN upsampling)")
        need(all(0 <= i < self.vision_layers for i in self.global_layers), "global layer index out of range")
        need(self.window_size > 0, "window_size must be positive")
        need(set(self.scale_factors) <= {4.0, 2.0, 1.0, 0.5}, "scale factors must be among 4, 2, 1, 0.5")
        need(len(self.scale_factors) == self.upsampling_stages + 1, "one FPN level per upsampling stage + 1")
        need(self.text_context >= 3, "text_context must hold BOS, a token and EOS")
        need(self.num_queries > 0 and self.encoder_layers > 0 and self.decoder_layers > 0, "empty detector")
        for a in (self.vision_act, self.text_act, self.detector_act):
            need(a in ACTIVATIONS, f"activation {a!r} not in {ACTIVATIONS}")

    @property
    def grid(self) -> int:
        """Patches per side at `image_size`."""
        return self.image_size // self.patch_size

    @property
    def mask_size(self) -> int:
        """Side of the mask logits: the finest pyramid level."""
        return int(self.grid * self.scale_factors[0])

    # ---- transformers' Sam3Config layout ----

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> SamConfig:
        """From a `Sam3Config` dict (a `sam3_video` config's `detector_config` is used when present)."""
        if isinstance(d.get("detector_config"), dict):
            d = d["detector_config"]
        v = d.get("vision_config") or {}
        b = v.get("backbone_config") or {}
        t = d.get("text_config") or {}
        e = d.get("detr_encoder_config") or {}
        dec = d.get("detr_decoder_config") or {}
        m = d.get("mask_decoder_config") or {}
        rope = b.get("rope_parameters") or {}

        def size(x: Any) -> int:
            if isinstance(x, (list, tuple)):
                if len(set(x)) != 1:
                    raise ValueError(f"SamConfig: non-square sizes are not supported: {x}")
                return int(x[0])
            return int(x)

        base = cls()
        kw: dict[str, Any] = dict(
            vision_hidden=b.get("hidden_size", base.vision_hidden),
            vision_intermediate=b.get("intermediate_size", base.vision_intermediate),
            vision_layers=b.get("num_hidden_layers", base.vision_layers),
            vision_heads=b.get("num_attention_heads", base.vision_heads),
            image_size=size(b.get("image_size", base.image_size)),
            patch_size=size(b.get("patch_size", base.patch_size)),
            window_size=b.get("window_size", base.window_size),
            global_layers=tuple(b.get("global_attn_indexes") or base.global_layers),
            pretrain_image_size=size(b.get("pretrain_image_size", base.pretrain_image_size)),
            vision_eps=b.get("layer_norm_eps", base.vision_eps),
            rope_theta=rope.get("rope_theta", base.rope_theta),
            vision_act=b.get("hidden_act", base.vision_act),
            fpn_hidden=v.get("fpn_hidden_size", base.fpn_hidden),
            scale_factors=tuple(v.get("scale_factors") or base.scale_factors),
            vocab_size=t.get("vocab_size", base.vocab_size),
            text_hidden=t.get("hidden_size", base.text_hidden),
            text_intermediate=t.get("intermediate_size", base.text_intermediate),
            text_layers=t.get("num_hidden_layers", base.text_layers),
            text_heads=t.get("num_attention_heads", base.text_heads),
            text_context=t.get("max_position_embeddings", base.text_context),
            text_projection_dim=t.get("projection_dim", base.text_projection_dim),
            text_eps=t.get("layer_norm_eps", base.text_eps),
            text_act=t.get("hidden_act", base.text_act),
            bos_token_id=t.get("bos_token_id", base.bos_token_id),
            eos_token_id=t.get("eos_token_id", base.eos_token_id),
            hidden=e.get("hidden_size", base.hidden),
            heads=e.get("num_attention_heads", base.heads),
            intermediate=e.get("intermediate_size", base.intermediate),
            encoder_layers=e.get("num_layers", base.encoder_layers),
            decoder_layers=dec.get("num_layers", base.decoder_layers),
            num_queries=dec.get("num_queries", base.num_queries),
            detector_act=e.get("hidden_act", base.detector_act),
            mask_heads=m.get("num_attention_heads", base.mask_heads),
            upsampling_stages=m.get("num_upsampling_stages", base.upsampling_stages),
        )
        for key, sub in (("detr_decoder_config", dec), ("mask_decoder_config", m)):
            if sub and sub.get("hidden_size", kw["hidden"]) != kw["hidden"]:
                raise ValueError(f"SamConfig: {key}.hidden_size differs from the encoder's")
        if dec and dec.get("intermediate_size", kw["intermediate"]) != kw["intermediate"]:
            raise ValueError("SamConfig: decoder and encoder intermediate sizes differ")
        if v.get("fpn_hidden_size", kw["hidden"]) != kw["hidden"]:
            raise ValueError("SamConfig: fpn_hidden_size must equal the detector's hidden size")
        return cls(**kw)

    def to_hf(self) -> dict[str, Any]:
        """A `Sam3Config(**d)` dict describing the same model (geometry encoder sized to `hidden`)."""
        g = self.grid
        sizes = [[int(g * s), int(g * s)] for s in self.scale_factors[:-1]]
        det = dict(
            hidden_size=self.hidden,
            num_attention_heads=self.heads,
            intermediate_size=self.intermediate,
            hidden_act=self.detector_act,
        )
        return dict(
            model_type="sam3",
            vision_config=dict(
                model_type="sam3_vision_model",
                backbone_config=dict(
                    model_type="sam3_vit_model",
                    hidden_size=self.vision_hidden,
                    intermediate_size=self.vision_intermediate,
                    num_hidden_layers=self.vision_layers,
                    num_attention_heads=self.vision_heads,
                    image_size=self.image_size,
                    patch_size=self.patch_size,
                    window_size=self.window_size,
                    global_attn_indexes=list(self.global_layers),
                    pretrain_image_size=self.pretrain_image_size,
                    layer_norm_eps=self.vision_eps,
                    hidden_act=self.vision_act,
                    rope_parameters=dict(rope_type="axial", rope_theta=self.rope_theta),
                ),
                fpn_hidden_size=self.fpn_hidden,
                scale_factors=list(self.scale_factors),
                backbone_feature_sizes=sizes,
            ),
            text_config=dict(
                model_type="clip_text_model",
                vocab_size=self.vocab_size,
                hidden_size=self.text_hidden,
                intermediate_size=self.text_intermediate,
                num_hidden_layers=self.text_layers,
                num_attention_heads=self.text_heads,
                max_position_embeddings=self.text_context,
                projection_dim=self.text_projection_dim,
                layer_norm_eps=self.text_eps,
                hidden_act=self.text_act,
                bos_token_id=self.bos_token_id,
                eos_token_id=self.eos_token_id,
            ),
            geometry_encoder_config=dict(
                hidden_size=self.hidden, num_attention_heads=self.heads, intermediate_size=self.intermediate
            ),
            detr_encoder_config=dict(det, num_layers=self.encoder_layers),
            detr_decoder_config=dict(det, num_layers=self.decoder_layers, num_queries=self.num_queries),
            mask_decoder_config=dict(
                hidden_size=self.hidden,
                num_attention_heads=self.mask_heads,
                num_upsampling_stages=self.upsampling_stages,
            ),
        )

    @classmethod
    def load(cls, path: str | Path) -> SamConfig:
        """From a config.json in transformers' layout, or a directory holding one."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise FileNotFoundError(f"no SAM 3 config at {p}")
        try:
            d = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{p} is not JSON: {e}") from None
        return cls.from_hf(d)

    def replace(self, **kw: Any) -> SamConfig:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d.update(kw)
        return SamConfig(**d)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def tiny_config(**kw: Any) -> SamConfig:
    """A small config with every structural feature (windowed + global layers, padded windows, tiled
    position table, 3 pyramid levels, several heads): for tests on the CPU."""
    base = dict(
        vision_hidden=32,
        vision_intermediate=64,
        vision_layers=4,
        vision_heads=2,
        image_size=140,
        patch_size=14,
        window_size=4,
        global_layers=(1, 3),
        pretrain_image_size=56,
        fpn_hidden=32,
        vocab_size=512,
        text_hidden=32,
        text_intermediate=64,
        text_layers=2,
        text_heads=2,
        text_context=16,
        text_projection_dim=16,
        bos_token_id=0,
        eos_token_id=1,
        hidden=32,
        heads=4,
        intermediate=64,
        encoder_layers=2,
        decoder_layers=2,
        num_queries=12,
        mask_heads=2,
    )
    base.update(kw)
    return SamConfig(**base)
