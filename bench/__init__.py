"""Benchmarks and evaluations: radixlm against a plain Hugging Face baseline, both sides in one invocation.

Every script runs as `python bench/<name>.py` (or `python -m bench.<name>`), prints a summary table and
writes `bench/results/<name>.json` plus a PNG plot; `python bench/run_all.py --quick` runs them all.
"""
