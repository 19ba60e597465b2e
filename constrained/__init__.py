"""Constrained decoding: regex / JSON Schema grammars over outlines-core, vocab masks and jump-forward.

Typical use by the runtime::

    validate_spec("json_schema", schema_text)           # HTTP process: GrammarError -> 400, before queueing
    compiler = GrammarCompiler(tokenizer, vocab_size)   # scheduler process, once
    future = compiler.compile_async("json_schema", schema_text)   # request waits; others keep decoding
    matcher = future.result().new_matcher()             # per request
    matcher.fill_vocab_mask(mask[row]); apply_vocab_mask(logits, mask)   # every step
    matcher.accept_token(sampled_id)
    forced = matcher.jump_forward_string()               # optional jump-forward
    if forced:
        keep, new_ids = compiler.plan_jump_forward(output_ids, forced)
        matcher.reset_to(output_ids[:keep] + new_ids)    # and drop KV past `keep`, prefill new_ids
"""

# Lazy (PEP 562): a compile worker process imports constrained.spec without pulling in torch, which would
# cost it ~300 MB of address space under its RLIMIT_AS cap and seconds of start-up.
_EXPORTS = {
    "CompiledGrammar": "constrained.grammar",
    "GrammarCompiler": "constrained.compiler",
    "GrammarError": "constrained.errors",
    "GrammarMatcher": "constrained.grammar",
    "TokenVocabulary": "constrained.vocab",
    "apply_vocab_mask": "constrained.grammar",
    "build_vocabulary": "constrained.vocab",
    "fill_vocab_masks": "constrained.grammar",
    "plan_jump_forward": "constrained.jump_forward",
    "validate_spec": "constrained.spec",
    "vocabulary_for": "constrained.vocab",
    "DEFAULT_WHITESPACE": "constrained.spec",
    "GRAMMAR_KINDS": "constrained.spec",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'constrained' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
