"""MetaInfer: a specialised inference engine (VibeQwen) for Qwen3.6-35B-A3B, its oracle and bench."""

__version__ = "0.1.0"
