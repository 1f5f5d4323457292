"""Test session setup: Triton kernels run in the interpreter on machines without CUDA."""

from __future__ import annotations

import os

try:
    import torch

    _cuda = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _cuda = False
if not _cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")
