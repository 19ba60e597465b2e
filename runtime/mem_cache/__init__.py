"""KV memory: the paged KV pool, request-to-token table, slot allocator, and the radix prefix cache.
Depends on torch only."""
