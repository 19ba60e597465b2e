"""Security defaults of a server started without --host: it listens on 127.0.0.1 only and on nothing else;
the API key (here from RADIXLM_API_KEY) guards every route but /health (routes taken from the app's own
OpenAPI schema, so a new endpoint is covered automatically); the admin key (here from --admin-api-key-file)
guards /flush_cache and abort_all; no key is on any command line; a Host header naming another site is
refused (DNS rebinding); a POST that is not JSON is refused (cross-site form / text/plain posts), so no web
page can abort other clients' requests; a 500 tells the client an error id, not the exception. The ZMQ ipc
directory is private (0700, sockets only, removed at exit); the inter-process messages are msgpack, never
pickle (a pickle payload is rejected without being executed).
"""

from __future__ import annotations

import logging
import os
import pickle
import re
import stat
import threading
import time
from pathlib import Path

import msgspec
import pytest
import requests

from tests.e2e.server_utils import ServerProcess, descendants

ROOT = Path(__file__).resolve().parents[2]
KEY = "s3cret-test-key-9f2c"
ADMIN_KEY = "adm1n-test-key-77e1"
AUTH = {"Authorization": f"Bearer {KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
ADMIN_ROUTES = {"/flush_cache", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"}
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
    "/concate_and_append_request": {"src_rids": ["a"], "dst_rid": "b"},
    "/v1/responses": {"model": "default", "input": "Hi", "max_output_tokens": 1},
    "/v1/messages": {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
    "/v1/messages/count_tokens": {"model": "default", "messages": [{"role": "user", "content": "Hi"}]},
    "/v1/load_lora_adapter": {"lora_name": "a", "lora_path": "/nonexistent"},
    "/v1/unload_lora_adapter": {"lora_name": "a"},
}


class DefaultHostServer(ServerProcess):
    """ServerProcess without `--host`, to test the default bind address."""

    def command(self) -> list[str]:
        cmd = super().command()
        i = cmd.index("--host")
        return cmd[:i] + cmd[i + 2 :]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    admin_file = tmp_path_factory.mktemp("keys") / "admin"
    admin_file.write_text(f"  {ADMIN_KEY}\n")
    admin_file.chmod(0o600)
    server = DefaultHostServer(
        extra_args=["--admin-api-key-file", str(admin_file), "--max-total-tokens", "2048"],
        env={"RADIXLM_API_KEY": KEY},
    )
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


# Routes whose answer past the guard is not 200 for the literal path: DELETE of the session named
# "{session_id}", which holds nothing, and GET / DELETE of the stored response "{response_id}", which does not
# exist (404 from the route itself, after the key was accepted).
PAST_GUARD_STATUS = {
    "/v1/sessions/{session_id}": 404,
    "/v1/responses/{response_id}": 404,
    "/v1/load_lora_adapter": 400,  # past the guard: this server serves no adapters
    "/v1/unload_lora_adapter": 400,
}


def test_api_key_guards_every_route_but_health(srv):
    server, _ = srv
    bad_headers = [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Bearer {KEY}x"},
        {"Authorization": KEY},
        {"Authorization": f"Bearer {KEY[:-1]}"},
        {"X-API-Key": "wrong"},
        {"X-API-Key": f"Bearer {KEY}"},
        {"X-API-Key": KEY[:-1]},
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
        if path in ADMIN_ROUTES:  # the API key is not enough: 403 naming the admin key
            r = requests.request(method, server.url + path, json=body, headers=AUTH, timeout=60)
            assert r.status_code == 403 and "admin" in r.json()["error"]["message"], (path, r.text)
        ok = PAST_GUARD_STATUS.get(path, 200)
        r = requests.request(method, server.url + path, json=body, headers=ADMIN, timeout=300)
        assert r.status_code == ok, (method, path, r.status_code, r.text)
        for key_headers in (AUTH, {"x-api-key": KEY}):  # OpenAI's header and Anthropic's
            r = requests.request(method, server.url + path, json=body, headers=key_headers, timeout=300)
            assert r.status_code == (403 if path in ADMIN_ROUTES else ok), (
                method,
                path,
                r.status_code,
                r.text,
            )
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
    assert info["api_key"] == "***" and info["admin_api_key"] == "***", info
    assert KEY not in str(info) and ADMIN_KEY not in str(info)
    assert KEY not in server.log() and ADMIN_KEY not in server.log()
    # Constant-time comparison (source check: timing is not measurable reliably in a test).
    assert "hmac.compare_digest" in (ROOT / "runtime" / "entrypoints" / "security.py").read_text()


def test_openai_client_with_and_without_key(srv):
    openai = pytest.importorskip("openai")
    server, _ = srv
    good = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)
    out = good.completions.create(model="default", prompt="Hello", max_tokens=1)
    assert out.usage.completion_tokens == 1
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_anthropic_client_with_and_without_key(srv):
    """anthropic.Anthropic(api_key=KEY) sends `x-api-key: KEY`: accepted like a bearer token; a wrong one is
    a 401 the client reports as an authentication error; admin routes need the admin key either way."""
    anthropic = pytest.importorskip("anthropic")
    server, _ = srv
    good = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=300)
    msg = good.messages.create(model="default", max_tokens=2, messages=[{"role": "user", "content": "Hello"}])
    assert msg.usage.output_tokens >= 1
    bad = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0, timeout=60)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model="default", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    flush = server.url + "/flush_cache"
    assert requests.post(flush, headers={"x-api-key": KEY}, timeout=60).status_code == 403
    assert requests.post(flush, headers={"x-api-key": ADMIN_KEY}, timeout=60).status_code == 200


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


# ---- keys off the command line -----------------------------------------------------------------------------
def test_keys_are_on_no_command_line(srv):
    server, _ = srv
    pids = [server.proc.pid, *descendants(server.proc.pid)]
    assert len(pids) >= 3, pids  # the server, its scheduler and detokenizer at least
    for pid in pids:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        assert KEY.encode() not in cmdline and ADMIN_KEY.encode() not in cmdline, (pid, cmdline)
    # ...and the key from the environment is the one enforced.
    assert requests.get(server.url + "/v1/models", timeout=30).status_code == 401
    assert requests.get(server.url + "/v1/models", headers=AUTH, timeout=30).status_code == 200


def test_keys_from_files_and_environment(tmp_path, monkeypatch):
    from runtime.launch_server import parse_args

    key_file = tmp_path / "key"
    key_file.write_text("\n  from-file-key \n")
    monkeypatch.setenv("RADIXLM_API_KEY", "from-env-key")
    monkeypatch.setenv("RADIXLM_ADMIN_API_KEY", "admin-from-env")
    args = parse_args(["--api-key-file", str(key_file)])
    assert (args.api_key, args.admin_api_key) == ("from-file-key", "admin-from-env")
    # Read once, then gone from the environment: the server's children do not inherit them.
    assert "RADIXLM_API_KEY" not in os.environ and "RADIXLM_ADMIN_API_KEY" not in os.environ
    monkeypatch.setenv("RADIXLM_API_KEY", "from-env-key")
    assert parse_args([]).api_key == "from-env-key"
    assert parse_args(["--api-key", "flag-key"]).api_key == "flag-key"  # an explicit option wins
    assert parse_args([]).api_key is None
    bad = [
        ["--api-key", "k", "--api-key-file", str(key_file)],  # two sources
        ["--api-key-file", str(tmp_path / "missing")],
        ["--admin-api-key", "same", "--api-key", "same"],  # the normal key would be an admin key
        ["--api-key", "has space"],
    ]
    (tmp_path / "empty").write_text(" \n")
    bad.append(["--admin-api-key-file", str(tmp_path / "empty")])
    for argv in bad:
        with pytest.raises(SystemExit):
            parse_args(argv)


def test_data_parallel_children_get_the_keys_by_environment(monkeypatch):
    from runtime.entrypoints import data_parallel as dp
    from runtime.server_args import ServerArgs

    monkeypatch.delenv("RADIXLM_API_KEY", raising=False)
    args = ServerArgs(dp_size=2, api_key=KEY, admin_api_key=ADMIN_KEY)
    argv = dp.replica_cli_args(args, 31001) + dp.router_cli_args(args, ["http://127.0.0.1:31001"], 31999)
    assert KEY not in " ".join(argv) and ADMIN_KEY not in " ".join(argv), argv
    env = dp.child_env(args)
    assert (env["RADIXLM_API_KEY"], env["RADIXLM_ADMIN_API_KEY"]) == (KEY, ADMIN_KEY)
    router_env = dp.child_env(args, router=True)  # the router gets the API key only
    assert router_env["RADIXLM_API_KEY"] == KEY and "RADIXLM_ADMIN_API_KEY" not in router_env
    assert "RADIXLM_API_KEY" not in dp.child_env(ServerArgs(dp_size=2))


# ---- aborting: only by rid, only with JSON; everything only by an admin ----------------------------------
def _in_flight(server: ServerProcess) -> int:
    info = requests.get(server.url + "/get_server_info", headers=AUTH, timeout=60).json()
    return info["requests_in_flight"]


class _Victim:
    """Another client's /generate running in a thread."""

    def __init__(self, server: ServerProcess, max_new_tokens: int):
        self.result: dict = {}
        body = {
            "text": "Count slowly:",
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True},
        }

        def run():
            r = requests.post(server.url + "/generate", json=body, headers=AUTH, timeout=600)
            self.result["status"], self.result["body"] = r.status_code, r.json()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while _in_flight(server) == 0:
            assert time.monotonic() < deadline, "the victim request never started"
            time.sleep(0.05)

    def meta(self) -> dict:
        self.thread.join(timeout=600)
        assert self.result["status"] == 200, self.result
        return self.result["body"]["meta_info"]


def _error(r: requests.Response, status: int, fragment: str) -> None:
    assert r.status_code == status, (r.status_code, r.text)
    message = r.json()["error"]["message"]
    assert fragment.lower() in message.lower(), message


def test_only_json_posts_with_a_rid_abort(srv):
    server, _ = srv
    url = server.url + "/abort_request"
    victim = _Victim(server, max_new_tokens=48)
    # The cross-site "simple" requests a web page can send without a preflight: none is read as JSON.
    text_plain = {**AUTH, "Content-Type": "text/plain"}
    _error(requests.post(url, data="{}", headers=text_plain, timeout=30), 415, "json")
    _error(requests.post(url, data=b"{}", headers=AUTH, timeout=30), 415, "json")  # no content type
    _error(requests.post(url, data={"rid": ""}, headers=AUTH, timeout=30), 415, "urlencoded")
    browser = {**AUTH, "Origin": "http://evil.example"}  # a browser's body-less POST carries an Origin
    _error(requests.post(url, headers=browser, timeout=30), 415, "json")
    # JSON without a rid aborts nothing either.
    for body, fragment in [
        ({}, "rid"),
        ({"rid": ""}, "rid"),
        ({"rid": "x" * 257}, "too long"),
        ({"rid": None}, "rid"),
        ({"abort_all": "yes"}, "abort_all"),
        ({"abort_all": True, "rid": "a"}, "not both"),
        ({"rid": "a", "everything": True}, "everything"),
    ]:
        _error(requests.post(url, json=body, headers=AUTH, timeout=30), 400, fragment)
    for content_type in ("application/json; charset=utf-8", "application/vnd.radixlm+json"):
        headers = {**AUTH, "Content-Type": content_type}
        r = requests.post(url, data=b'{"rid": "nobody"}', headers=headers, timeout=30)
        assert r.status_code == 200 and r.json()["success"], r.text
    assert not victim.result, "the victim finished before the checks: raise its max_new_tokens"
    meta = victim.meta()
    assert meta["completion_tokens"] == 48 and meta["finish_reason"]["type"] == "length", meta


def test_admin_key_guards_abort_all_and_flush(srv):
    server, _ = srv
    url = server.url + "/abort_request"
    victim = _Victim(server, max_new_tokens=1500)
    try:
        _error(requests.post(url, json={"abort_all": True}, headers=AUTH, timeout=30), 403, "admin")
        _error(requests.post(server.url + "/flush_cache", headers=AUTH, timeout=30), 403, "admin")
        assert not victim.result and _in_flight(server) == 1
    finally:
        r = requests.post(url, json={"abort_all": True}, headers=ADMIN, timeout=30)
    assert r.status_code == 200 and r.json()["success"], r.text
    meta = victim.meta()
    assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < 1500, meta
    # The admin key is also an API key; body-less admin POSTs (what sglang-router sends) are fine.
    assert requests.post(server.url + "/flush_cache", headers=ADMIN, timeout=60).status_code == 200
    assert requests.get(server.url + "/get_model_info", headers=ADMIN, timeout=60).status_code == 200


# ---- Host header (DNS rebinding) ---------------------------------------------------------------------------
def test_foreign_host_header_is_refused(srv):
    server, _ = srv
    for host in ("evil.example", f"evil.example:{server.port}", "127.0.0.1.evil.example", "[::2]"):
        r = requests.get(server.url + "/get_server_info", headers={**AUTH, "Host": host}, timeout=30)
        _error(r, 421, "evil.example" if "evil" in host else "::2")
        assert "max_total_tokens" not in r.text
        body = {"text": "Hi", "sampling_params": {"max_new_tokens": 1}}
        r = requests.post(server.url + "/generate", json=body, headers={**AUTH, "Host": host}, timeout=30)
        assert r.status_code == 421, r.text
    for host in (f"127.0.0.1:{server.port}", f"localhost:{server.port}", "LOCALHOST", f"[::1]:{server.port}"):
        r = requests.get(server.url + "/get_server_info", headers={**AUTH, "Host": host}, timeout=30)
        assert r.status_code == 200, (host, r.text)


def test_allowed_hosts_defaults_and_option():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from runtime.entrypoints.security import Guard, allowed_hosts
    from runtime.server_args import ServerArgs

    assert allowed_hosts(ServerArgs()) == {"127.0.0.1", "localhost", "::1"}
    assert allowed_hosts(ServerArgs(host="10.1.2.3")) == {"10.1.2.3", "127.0.0.1", "localhost", "::1"}
    assert allowed_hosts(ServerArgs(host="0.0.0.0")) is None  # every address of the machine: any name
    assert allowed_hosts(ServerArgs(host="::")) is None
    assert allowed_hosts(ServerArgs(host="0.0.0.0", allowed_hosts="LLM.example.com:443, [::1]")) == {
        "llm.example.com",
        "::1",
    }
    assert allowed_hosts(ServerArgs(allowed_hosts="*")) is None
    for bad in (ServerArgs, lambda **kw: ServerArgs(dp_size=2, **kw)):
        with pytest.raises(ValueError, match="allowed-hosts"):
            bad(allowed_hosts="a.example, ,b" if bad is ServerArgs else "a.example")

    app = FastAPI()
    app.get("/x")(lambda: {"ok": True})
    guarded = Guard(app, ServerArgs(host="0.0.0.0", allowed_hosts="llm.example.com"))
    client = TestClient(guarded, base_url="http://llm.example.com")
    assert client.get("/x").status_code == 200
    assert client.get("/x", headers={"Host": "evil.example"}).status_code == 421
    assert client.get("/x", headers={"Host": "127.0.0.1"}).status_code == 421  # only what was listed
    open_client = TestClient(Guard(app, ServerArgs(host="0.0.0.0")), base_url="http://203.0.113.9:30000")
    assert open_client.get("/x").status_code == 200


# ---- a 500 says nothing about its cause --------------------------------------------------------------------
def test_internal_error_answer_hides_the_exception(caplog):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from runtime.entrypoints.server import add_error_handlers

    app = FastAPI()
    add_error_handlers(app)

    @app.get("/boom")
    async def boom():
        raise RuntimeError("secret detail: /home/operator/.cache token=abc123")

    with caplog.at_level(logging.ERROR, logger="radixlm.server"):
        r = TestClient(app, raise_server_exceptions=False).get("/boom")
    assert r.status_code == 500
    err = r.json()["error"]
    assert "secret" not in r.text and "RuntimeError" not in r.text and "abc123" not in r.text, r.text
    error_id = re.search(r"\berr-[0-9a-f]{12}\b", err["message"]).group(0)
    assert err["type"] == "internal_error" and "server log" in err["message"]
    logged = [rec for rec in caplog.records if error_id in rec.getMessage()]
    assert logged and "secret detail" in str(logged[0].exc_info[1]), caplog.text


# ---- the scheduler: rid "" aborts nothing; only abort_all aborts everything --------------------------------
def test_scheduler_aborts_all_only_when_asked(default_model_dir, default_tokenizer):
    from runtime.messages import AbortReq, GenerateReq
    from runtime.sampling_params import SamplingParams
    from tests.scheduler_utils import make_scheduler

    sched = make_scheduler(default_model_dir, default_tokenizer, max_total_tokens=2048, num_threads=1)
    params = SamplingParams(max_new_tokens=50, temperature=0.0, ignore_eos=True)
    for i in range(3):
        sched.handle(GenerateReq(rid=f"r{i}", input_ids=[5 + i, 6, 7], params=params))
    sched.step()
    sched.handle(AbortReq(rid=""))
    finished = {o.rid: o.finished_reason["type"] for o in sched.step() if o.finished_reason}
    assert not finished and sched.has_work()
    sched.handle(AbortReq(abort_all=True))
    finished = {o.rid: o.finished_reason["type"] for o in sched.step() if o.finished_reason}
    assert finished == {"r0": "abort", "r1": "abort", "r2": "abort"}
    assert not sched.has_work()
