"""Backends that run DSL programs: a radixlm server over HTTP, an in-process Engine, an OpenAI endpoint."""

from lang.backends.base import Backend, GenResult, Prompt, SelectResult
from lang.backends.engine import EngineBackend
from lang.backends.openai_backend import OpenAI
from lang.backends.runtime_endpoint import RuntimeEndpoint

__all__ = ["Backend", "EngineBackend", "GenResult", "OpenAI", "Prompt", "RuntimeEndpoint", "SelectResult"]
