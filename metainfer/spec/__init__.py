"""Speculative decoding: draft proposers; the engine verifies drafts (engine/scheduler, runner)."""
