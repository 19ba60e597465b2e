"""The OpenAI-compatible API: request bodies (`protocol`), routes and their translation to native requests
(`routes`), and OpenAI's response and stream objects (`formatters`)."""

from runtime.entrypoints.openai.routes import register_openai_routes

__all__ = ["register_openai_routes"]
