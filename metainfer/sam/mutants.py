"""Planted bugs for proving the oracle: each returns a patched copy of our model (never the reference).

skip_global_attention: the first global-attention ViT layer does nothing.
drop_presence: scores ignore the presence token (presence logit forced to its +10 clamp).
wrong_query_masks: each query gets the next query's mask.
prompt_independent: every prompt is encoded as the batch's first prompt.
cross_image_leak: in a batch, each image's features are pulled halfway to the batch mean.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from metainfer.sam.model import SamModel, SamOutput


def skip_global_attention(model: SamModel) -> SamModel:
    m = copy.deepcopy(model)
    layer = m.vision_encoder.backbone.layers[m.config.global_layers[0]]
    layer.forward = lambda x: x
    return m


def _wrap_detect(model: SamModel, change: Callable[[SamOutput], SamOutput]) -> SamModel:
    m = copy.deepcopy(model)
    detect = m.detect
    m.detect = lambda levels, prompt, valid: change(detect(levels, prompt, valid))
    return m


def drop_presence(model: SamModel) -> SamModel:
    return _wrap_detect(
        model, lambda o: SamOutput(o.logits, torch.full_like(o.presence_logits, 10.0), o.boxes, o.masks)
    )


def wrong_query_masks(model: SamModel) -> SamModel:
    return _wrap_detect(
        model, lambda o: SamOutput(o.logits, o.presence_logits, o.boxes, o.masks.roll(1, dims=1))
    )


def prompt_independent(model: SamModel) -> SamModel:
    m = copy.deepcopy(model)
    encode = m.encode_text
    m.encode_text = lambda ids, valid: encode(ids[:1].expand_as(ids), valid[:1].expand_as(valid))
    return m


def cross_image_leak(model: SamModel) -> SamModel:
    m = copy.deepcopy(model)
    encode = m.encode_images

    def leaky(pixel_values: torch.Tensor) -> list[torch.Tensor]:
        return [lv + 0.5 * (lv.mean(0, keepdim=True) - lv) for lv in encode(pixel_values)]

    m.encode_images = leaky
    return m


MUTANTS: dict[str, Callable[[SamModel], SamModel]] = {
    "skip_global_attention": skip_global_attention,
    "drop_presence": drop_presence,
    "wrong_query_masks": wrong_query_masks,
    "prompt_independent": prompt_independent,
    "cross_image_leak": cross_image_leak,
}
