"""Modules that run in the HTTP process (the tokenizer side of the trio): the tokenizer manager, the
supervisor of the child processes, the native request shape and the early grammar check."""
