"""Benchmarks and evaluations: radixlm against a plain Hugging Face baseline (and llama.cpp where it applies),
all sides in one invocation.

Every benchmark runs from the repository root as `python -m bench.<name>`, prints a summary table and writes
`bench/results/<name>.json` plus a PNG plot; `python -m bench.run_all --quick` runs them all. Shared code
is in `bench.harness`, the data sets in bench/data.
"""
