"""`metainfer bench`: serving and offline benchmarks, the roofline model, engine comparisons, reports.

Modules: `client` (OpenAI-compatible streaming load generator), `datasets` (prompt sets), `metrics`
(per-request outcomes -> summary in `vllm bench serve` terms), `roofline` (bytes/FLOPs per step and
the resulting ceilings), `offline` (the engine's Python API without HTTP), `compare` (start each
engine's server and run the same workloads), `report` (markdown + PNG plots), `env` (result metadata).
"""
