"""radixlm's frontend DSL: write multi-call LLM programs in Python; run them on a server, an engine or OpenAI.

    from lang import function, gen, select, system, user, assistant, RuntimeEndpoint

    @function
    def qa(s, question):
        s += user(question)
        s += assistant(gen("answer", max_tokens=64))

    state = qa.run(question="...", backend=RuntimeEndpoint("http://127.0.0.1:30000"))
    print(state["answer"])

Layers: `api` builds IR nodes (`ir`), the `interpreter` executes them against a backend (`backends`), and
`state`/`program` are what users hold.
"""

from lang.api import (
    assistant,
    assistant_begin,
    assistant_end,
    gen,
    gen_int,
    gen_string,
    select,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
)
from lang.backends import Backend, EngineBackend, OpenAI, RuntimeEndpoint
from lang.errors import BackendError, ProgramError
from lang.program import Program, function, get_default_backend, set_default_backend
from lang.state import ForkGroup, ProgramState

__all__ = [
    "Backend",
    "BackendError",
    "EngineBackend",
    "ForkGroup",
    "OpenAI",
    "Program",
    "ProgramError",
    "ProgramState",
    "RuntimeEndpoint",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "function",
    "gen",
    "gen_int",
    "gen_string",
    "get_default_backend",
    "select",
    "set_default_backend",
    "system",
    "system_begin",
    "system_end",
    "user",
    "user_begin",
    "user_end",
]
