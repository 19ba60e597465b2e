"""The detokenizer process: token ids -> incremental text, stop strings trimmed."""
