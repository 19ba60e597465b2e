"""What the benchmarks share but is not a benchmark: statistics and result files (`common`), the sides a run
compares (`sides`, with the HF baseline in `hf_model` and `hf_backend`), the DSL workload runner (`workload`)
and the data set loaders (`datasets`, reading bench/data). Modules here never import a benchmark module.
"""
