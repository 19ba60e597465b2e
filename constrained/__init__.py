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

from constrained.compiler import GrammarCompiler
from constrained.errors import GrammarError
from constrained.grammar import CompiledGrammar, GrammarMatcher, apply_vocab_mask, fill_vocab_masks
from constrained.jump_forward import plan_jump_forward
from constrained.spec import DEFAULT_WHITESPACE, GRAMMAR_KINDS, validate_spec
from constrained.vocab import TokenVocabulary, build_vocabulary, vocabulary_for

__all__ = [
    "DEFAULT_WHITESPACE",
    "GRAMMAR_KINDS",
    "CompiledGrammar",
    "GrammarCompiler",
    "GrammarError",
    "GrammarMatcher",
    "TokenVocabulary",
    "apply_vocab_mask",
    "build_vocabulary",
    "fill_vocab_masks",
    "plan_jump_forward",
    "validate_spec",
    "vocabulary_for",
]
