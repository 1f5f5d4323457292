"""The SAM 3 image model (text prompts): our implementation, under transformers' `Sam3Model` parameter
names so a checkpoint's state dict loads as it is stored.

forward(pixel_values [B, 3, S, S], input_ids [P, T], valid [P, T], image_index [P]) runs the vision stage
once per image and the text + detector stages once per prompt: prompt p reads image image_index[p].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from metainfer.sam.config import SamConfig
from metainfer.sam.detector import DetrDecoder, DetrEncoder, DotProductScoring, MaskDecoder
from metainfer.sam.layers import cxcywh_to_xyxy
from metainfer.sam.text import ClipWithProjection
from metainfer.sam.vision import VisionEncoder, level_positions

# checkpoint entries this image path does not use (box prompts, CLIP's own projection, the semantic head,
# the coarsest pyramid level, the video tracker); everything else must load
UNUSED_PREFIXES = (
    "geometry_encoder.",
    "text_encoder.text_projection.",
    "mask_decoder.semantic_projection.",
    "tracker_model.",
    "tracker_neck.",
)


def unused_key(config: SamConfig, key: str) -> bool:
    last = len(config.scale_factors) - 1
    return key.startswith(UNUSED_PREFIXES) or key.startswith(f"vision_encoder.neck.fpn_layers.{last}.")


@dataclass
class SamOutput:
    logits: torch.Tensor  # [P, Q] query logits
    presence_logits: torch.Tensor  # [P, 1]
    boxes: torch.Tensor  # [P, Q, 4] (x0, y0, x1, y1), normalised to [0, 1]
    masks: torch.Tensor  # [P, Q, m, m] mask logits at the finest pyramid level

    def scores(self) -> torch.Tensor:
        """[P, Q] = sigmoid(logit) × sigmoid(presence)."""
        return self.logits.sigmoid() * self.presence_logits.sigmoid()


class SamModel(nn.Module):
    def __init__(self, config: SamConfig) -> None:
        super().__init__()
        self.config = config
        self.vision_encoder = VisionEncoder(config)
        self.text_encoder = ClipWithProjection(config)
        self.text_projection = nn.Linear(config.text_hidden, config.hidden)
        self.detr_encoder = DetrEncoder(config)
        self.detr_decoder = DetrDecoder(config)
        self.mask_decoder = MaskDecoder(config)
        self.dot_product_scoring = DotProductScoring(config)

    def encode_images(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        """[B, 3, S, S] -> pyramid levels [B, D, h_i, w_i], finest first."""
        return self.vision_encoder(pixel_values)

    def encode_text(self, input_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """[P, T] ids and bool mask -> prompt features [P, T, D]."""
        if input_ids.shape[1] > self.config.text_context:
            raise ValueError(
                f"prompt of {input_ids.shape[1]} tokens exceeds the {self.config.text_context} context"
            )
        return self.text_projection(self.text_encoder.text_model(input_ids, valid))

    def detect(self, levels: list[torch.Tensor], prompt: torch.Tensor, valid: torch.Tensor) -> SamOutput:
        """levels: one pyramid per prompt ([P, D, h_i, w_i]); prompt [P, T, D]; valid [P, T]."""
        coarse = levels[-1]
        hw = (coarse.shape[-2], coarse.shape[-1])
        img = coarse.flatten(2).transpose(1, 2)  # [P, N, D]
        pos = level_positions([coarse])[0].flatten(1).transpose(0, 1)[None]  # [1, N, D]
        img = self.detr_encoder(img, pos, prompt, valid)
        dec = self.detr_decoder(img, pos, hw, prompt, valid)
        logits = self.dot_product_scoring(dec.queries, prompt, valid)
        masks = self.mask_decoder(dec.queries, levels, img, prompt, valid)
        return SamOutput(logits, dec.presence_logits, cxcywh_to_xyxy(dec.boxes), masks)

    def forward(
        self,
        pixel_values: torch.Tensor,
        input_ids: torch.Tensor,
        valid: torch.Tensor,
        image_index: torch.Tensor | None = None,
    ) -> SamOutput:
        levels = self.encode_images(pixel_values)
        if image_index is None:
            if pixel_values.shape[0] != input_ids.shape[0]:
                raise ValueError("without image_index, give one prompt per image")
        else:
            levels = [lv.index_select(0, image_index) for lv in levels]
        return self.detect(levels, self.encode_text(input_ids, valid), valid)
