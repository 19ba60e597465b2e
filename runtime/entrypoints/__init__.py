"""HTTP entry points: FastAPI app, native and OpenAI routes, CLI, server launch (the HTTP process)."""
