"""Sammie: the SAM 3 image model (text prompts) — our model code, weights, processing, oracle and CLI.

Stages: `vision` (ViT + pyramid), `text` (CLIP), `detector` (fusion encoder, DETR decoder, scoring, masks),
assembled in `model`; `weights` loads checkpoints or builds peaked dummy weights; `processing` does the
pre/postprocessing; `oracle` judges the model against transformers' Sam3Model.
"""
