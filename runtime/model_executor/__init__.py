"""Model execution in the scheduler process: model runner, forward batch, sampler, CUDA graphs."""
