"""Fixtures shared by the end-to-end tests: one real server on the default model for the whole session.

Other e2e modules can start their own servers with `from tests.e2e.server_utils import ServerProcess` (the
repository root is on sys.path through pytest's `pythonpath` in pyproject.toml). Set
RADIXLM_TEST_SERVER_URL to test an already running server instead of starting one (tests that need the
process itself are skipped).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import anthropic
import openai
import pytest

from tests.e2e.server_utils import ServerProcess

MAX_TOTAL_TOKENS = 20000
EXTERNAL_URL = os.environ.get("RADIXLM_TEST_SERVER_URL")


@pytest.fixture(scope="session")
def server() -> Iterator[ServerProcess]:
    """The shared server: `--model default --max-total-tokens 20000`. Stopping it must be clean: exit code 0
    after SIGTERM and no surviving child process (checked by `ServerProcess.stop`)."""
    if EXTERNAL_URL:
        pytest.skip("RADIXLM_TEST_SERVER_URL is set: not starting a server process")
    srv = ServerProcess(extra_args=["--max-total-tokens", str(MAX_TOTAL_TOKENS)]).start()
    try:
        yield srv
    finally:
        code = srv.stop()
    assert code == 0, f"server exited with {code} after SIGTERM; log tail:\n{srv.log_tail()}"


@pytest.fixture(scope="session")
def server_url(request: pytest.FixtureRequest) -> str:
    if EXTERNAL_URL:
        return EXTERNAL_URL.rstrip("/")
    return request.getfixturevalue("server").url


# The official clients on the shared server (tests that must not retry or wait less than a slow 2-core
# decode take these): module-scoped, closed after the module.
@pytest.fixture(scope="module")
def oai(server_url: str) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=server_url + "/v1", api_key="unused", timeout=600, max_retries=0)
    yield c
    c.close()


@pytest.fixture(scope="module")
def claude(server_url: str) -> Iterator[anthropic.Anthropic]:
    c = anthropic.Anthropic(base_url=server_url, api_key="unused", timeout=600, max_retries=0)
    yield c
    c.close()
