"""bench/startup.py's checks that need no server: side names, and a side that dies before its first token."""

import subprocess
import sys
import time

import pytest

from bench import startup


@pytest.mark.parametrize(
    "sides, message",
    [("radixlm-cold,sglang", "unknown ['sglang']"), ("radixlm-warm", "radixlm-warm reuses the directory")],
)
def test_bad_sides_are_named(sides, message, capsys):
    with pytest.raises(SystemExit):
        startup.main(["--sides", sides])
    assert message in capsys.readouterr().err


def test_a_server_that_exits_fails_with_its_code(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait()
    with pytest.raises(RuntimeError, match="exited with 3"):
        startup.first_token("http://127.0.0.1:9", "m", time.monotonic() + 30, proc, tmp_path / "x.log")


def test_no_first_token_before_the_deadline_is_a_timeout(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with pytest.raises(TimeoutError):
            startup.first_token("http://127.0.0.1:9", "m", time.monotonic() + 0.6, proc, tmp_path / "x.log")
    finally:
        proc.kill()
