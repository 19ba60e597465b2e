"""Security defaults of a server started without --host: it listens on 127.0.0.1 only and on nothing else;
--api-key guards every route but /health (routes taken from the app's own OpenAPI schema, so a new endpoint
is covered automatically); the ZMQ ipc directory is private (0700, sockets only, removed at exit); and the
inter-process messages are msgpack, never pickle (a pickle payload is rejected without being executed).
"""

from __future__ import annotations

import os
import pickle
import re
import stat
from pathlib import Path

import msgspec
import pytest
import requests

from tests.e2e.server_utils import ServerProcess, descendants

ROOT = Path(__file__).resolve().parents[2]
KEY = "s3cret-test-key-9f2c"
AUTH = {"Authorization": f"Bearer {KEY}"}
# A valid body per POST route, so "authorized" is shown by the route actually working.
VALID_BODIES = {
    "/generate": {"text": "Hi", "sampling_params": {"max_new_tokens": 1}},
    "/v1/completions": {"model": "default", "prompt": "Hi", "max_tokens": 1},
    "/v1/chat/completions": {
        "model": "default",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 1,
    },
    "/abort_request": {"rid": "nothing-to-abort"},
}


class DefaultHostServer(ServerProcess):
    """ServerProcess without `--host`, to test the default bind address."""

    def command(self) -> list[str]:
        cmd = super().command()
        i = cmd.index("--host")
        return cmd[:i] + cmd[i + 2 :]


@pytest.fixture(scope="module")
def srv():
    server = DefaultHostServer(extra_args=["--api-key", KEY, "--max-total-tokens", "2048"])
    server.start()
    info = {"ipc_dir": _ipc_dir(server)}
    yield server, info
    assert server.stop() == 0, server.log_tail()
    assert not os.path.exists(info["ipc_dir"]), "the ipc directory outlived the server"


# ---- /proc helpers -----------------------------------------------------------------------------------------
def _socket_inodes(pids: list[int]) -> set[str]:
    out = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:  # closed while we looked
                continue
            if link.startswith("socket:["):
                out.add(link[8:-1])
    return out


def _listening_tcp(inodes: set[str]) -> list[tuple[str, int]]:
    """(address, port) of every listening TCP socket (v4 and v6) among `inodes`."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] != "0A" or f[9] not in inodes:  # 0A = TCP_LISTEN
                continue
            addr_hex, port_hex = f[1].split(":")
            if len(addr_hex) == 8:  # IPv4, little-endian
                addr = ".".join(str(int(addr_hex[i : i + 2], 16)) for i in (6, 4, 2, 0))
            else:
                addr = "ipv6:" + addr_hex
            found.append((addr, int(port_hex, 16)))
    return found


def _ipc_dir(server: ServerProcess) -> str:
    inodes = _socket_inodes([server.proc.pid, *descendants(server.proc.pid)])
    dirs = set()
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        f = line.split()
        if len(f) >= 8 and f[6] in inodes and f[7].startswith("/"):
            dirs.add(os.path.dirname(f[7]))
    assert len(dirs) == 1, f"expected one ipc directory, found {dirs}"
    return dirs.pop()


# ---- tests -------------------------------------------------------------------------------------------------
def test_default_bind_is_loopback_only(srv):
    server, _ = srv
    assert "--host" not in server.command()
    pids = [server.proc.pid, *descendants(server.proc.pid)]
    listening = _listening_tcp(_socket_inodes(pids))
    # Exactly one listening TCP socket in the whole process tree: HTTP on 127.0.0.1 (ZMQ is ipc://, no TCP).
    assert listening == [("127.0.0.1", server.port)], listening


def _routes(server: ServerProcess) -> list[tuple[str, str]]:
    schema = requests.get(server.url + "/openapi.json", headers=AUTH, timeout=30)
    assert schema.status_code == 200
    routes = [(m.upper(), p) for p, ops in schema.json()["paths"].items() for m in ops]
    assert ("POST", "/generate") in routes and ("GET", "/health") in routes, routes
    return routes + [("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/redoc")]


def test_api_key_guards_every_route_but_health(srv):
    server, _ = srv
    bad_headers = [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Bearer {KEY}x"},
        {"Authorization": KEY},
        {"Authorization": f"Bearer {KEY[:-1]}"},
        {"X-API-Key": KEY},
    ]
    for method, path in _routes(server):
        body = VALID_BODIES.get(path, {}) if method == "POST" else None
        for headers in bad_headers:
            r = requests.request(method, server.url + path, json=body, headers=headers, timeout=60)
            if path == "/health":
                assert r.status_code == 200, (method, path, headers, r.text)
                continue
            assert r.status_code == 401, (method, path, headers, r.status_code, r.text)
            err = r.json()["error"]
            assert err["type"] == "authentication_error" and "API key" in err["message"], err
        r = requests.request(method, server.url + path, json=body, headers=AUTH, timeout=300)
        assert r.status_code == 200, (method, path, r.status_code, r.text)
    # Unknown paths and other methods do not reveal anything without the key either.
    for method, path in [
        ("GET", "/nope"),
        ("OPTIONS", "/generate"),
        ("HEAD", "/get_server_info"),
        ("GET", "/health/../get_server_info"),
        ("GET", "/health/"),
    ]:
        assert requests.request(method, server.url + path, timeout=30).status_code == 401, (method, path)


def test_api_key_is_not_disclosed(srv):
    server, _ = srv
    info = requests.get(server.url + "/get_server_info", headers=AUTH, timeout=60).json()
    assert info["api_key"] != KEY and KEY not in str(info)
    assert KEY not in server.log()
    # Constant-time comparison (source check: timing is not measurable reliably in a test).
    assert "hmac.compare_digest" in (ROOT / "runtime" / "entrypoints" / "server.py").read_text()


def test_openai_client_with_and_without_key(srv):
    openai = pytest.importorskip("openai")
    server, _ = srv
    good = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)
    out = good.completions.create(model="default", prompt="Hello", max_tokens=1)
    assert out.usage.completion_tokens == 1
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_ipc_directory_is_private(srv):
    _, info = srv
    d = info["ipc_dir"]
    st = os.stat(d)
    assert stat.S_IMODE(st.st_mode) == 0o700, oct(st.st_mode)
    assert st.st_uid == os.getuid()
    entries = os.listdir(d)
    assert entries and set(entries) <= {"scheduler", "detokenizer", "tokenizer"}, entries
    for name in entries:
        assert stat.S_ISSOCK(os.lstat(os.path.join(d, name)).st_mode), name


def test_ipc_messages_are_msgpack_not_pickle(tmp_path):
    for rel in ("runtime/ipc.py", "runtime/messages.py"):
        src = (ROOT / rel).read_text()
        assert not re.search(r"^\s*(import|from)\s+(c?pickle|cloudpickle|dill|marshal)\b", src, re.M), rel
        assert "pickle.load" not in src and "marshal.load" not in src, rel
    from runtime import messages

    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    with pytest.raises(msgspec.DecodeError):
        messages.decode(pickle.dumps(Exploit()))
    assert not marker.exists()
    # A well-formed msgpack message of the wrong shape is rejected by type, too.
    with pytest.raises(msgspec.ValidationError):
        messages.decode(msgspec.msgpack.encode({"type": "AbortReq", "rid": 5}))
