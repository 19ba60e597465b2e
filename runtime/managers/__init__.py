"""Request managers: tokenizer manager and supervisor (HTTP process), scheduler and its policy, cache
manager and request state (scheduler process), detokenizer (its own process)."""
