"""Replicas of the engine behind one OpenAI endpoint, on Ray Serve.

Ray is an optional dependency (`pip install -e ".[ray]"`): only `ray_serve` imports it; `spec`,
`routing`, `asgi` and `cli` do not, so `metainfer serve` without `--replicas` never needs Ray.
"""
