"""Every query snippet of README.md runs, unchanged but for the server's address, against a real server.

The snippets are the fenced blocks of the README's "Query" section: curl on the native API, the OpenAI client
with a tool, the Anthropic client, the OpenAI Agents SDK and the DSL. Each runs in its own process, as a user
would paste it, and must exit 0 and print something.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_URL = "http://127.0.0.1:30000"
FENCE = re.compile(r"```(bash|python)\n(.*?)```", re.S)


def query_snippets() -> list[tuple[str, str]]:
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Query\n", 1)[1].split("\n## ", 1)[0]
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(section)]


def test_readme_has_the_five_query_snippets():
    snippets = query_snippets()
    assert [lang for lang, _ in snippets] == ["bash", "python", "python", "python", "python"]
    joined = "\n".join(code for _, code in snippets)
    for needle in ("/generate", "tools=", "anthropic.Anthropic", "from agents import", "from lang import"):
        assert needle in joined, needle


@pytest.mark.slow
@pytest.mark.parametrize("index", range(5), ids=["curl", "openai-tool", "anthropic", "agents-sdk", "dsl"])
def test_readme_snippet_runs(server_url, index):
    lang, code = query_snippets()[index]
    if "from agents import" in code:
        pytest.importorskip("agents")
    code = code.replace(README_URL, server_url)
    argv = ["bash", "-euo", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    output = f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    assert done.returncode == 0, f"snippet {index} failed:\n{code}\n{output}"
    assert done.stdout.strip(), f"snippet {index} printed nothing"
    if lang == "bash":  # curl exits 0 on an HTTP error too: the answer must be a generation
        assert '"text"' in done.stdout and '"error"' not in done.stdout, done.stdout
