"""The oracle's reference: transformers' `Sam3Model` in fp32 with TF32 off, holding the same weights as
the model under test (copied from it, so a checkpoint is read once). Code this project does not write.
"""

from __future__ import annotations

import contextlib
import copy

import torch

from metainfer.sam.model import SamModel, SamOutput, unused_key


@contextlib.contextmanager
def no_tf32():
    """fp32 matmuls and convolutions at full precision while inside."""
    m, c = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = m, c


class Reference:
    def __init__(self, model: SamModel) -> None:
        from transformers import Sam3Config, Sam3Model

        cfg = model.config
        device = next(model.parameters()).device
        with torch.device(device):
            ref = Sam3Model(Sam3Config(**cfg.to_hf()))
        state = {k: v.detach().float() for k, v in model.state_dict().items()}
        missing, unexpected = ref.load_state_dict(state, strict=False)
        if unexpected or any(not unused_key(cfg, k) for k in missing):
            bad = unexpected or [k for k in missing if not unused_key(cfg, k)]
            raise RuntimeError(f"reference does not take our tensors: {bad[:5]}")
        self.model = ref.float().eval()
        self.device = device

    @torch.no_grad()
    def __call__(
        self, pixel_values: torch.Tensor, input_ids: torch.Tensor, valid: torch.Tensor, dtype=torch.float32
    ) -> SamOutput:
        """One image [1, 3, S, S] and its P prompts -> outputs (fp32) for the P prompts. A dtype other than
        fp32 runs a copy of the reference in that precision (its own drift, for the report)."""
        model = self.model
        if dtype != torch.float32:
            if getattr(self, "_lowp", (None, None))[0] != dtype:
                self._lowp = (dtype, copy.deepcopy(self.model).to(dtype))
            model = self._lowp[1]
        p = input_ids.shape[0]
        with no_tf32():
            o = model(
                pixel_values=pixel_values.to(dtype).expand(p, -1, -1, -1),
                input_ids=input_ids,
                attention_mask=valid.long(),
            )
        return SamOutput(
            o.pred_logits.float(), o.presence_logits.float(), o.pred_boxes.float(), o.pred_masks.float()
        )
