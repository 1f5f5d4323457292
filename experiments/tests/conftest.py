"""The experiments' own tests (not in CI: `python -m pytest -q experiments/tests`). Triton kernels run in the
interpreter on machines without CUDA, as in tests/."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
