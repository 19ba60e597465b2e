"""Modules that run in the scheduler process: the scheduler loop and its parts (admission policy, KV
cache manager, batch building, per-request state, output stream, stop checks, grammars)."""
