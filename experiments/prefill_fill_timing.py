"""Host time of `PrefillGraphs._fill` (staging one lone-prefill step's inputs) on the CPU, for a tree:

    python experiments/prefill_fill_timing.py .                 # this tree
    python experiments/prefill_fill_timing.py .bisect/<sha>     # a `git archive` of an older one

A 5-token chunk (a K = 4 speculative verify) and a 1k-token prompt, mean of 2,000 calls each.
"""

from __future__ import annotations

import sys
import timeit

import torch

sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else ".")
from metainfer.engine.prefill_graph import PrefillGraphs  # noqa: E402

pg = PrefillGraphs(None, None, [5, 16, 1024], 128, 16, torch.device("cpu"), use_graphs=False, logits_rows=5)
blocks = list(range(1, 70))
for n, start in ((5, 1000), (1024, 0)):
    toks = list(range(n))
    size, rows = pg.size_for(n), min(5, n)
    t = timeit.timeit(lambda a=(size, toks, start, blocks, 3), r=rows: pg._fill(*a, rows=r), number=2000)
    print(f"{sys.argv[1] if len(sys.argv) > 1 else '.'}: {n} tokens {t / 2000 * 1e6:.1f} us")
