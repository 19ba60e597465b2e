"""`--dp-size N`: N full radixlm servers behind sglang-router on the public port.

Each replica is a complete server (`python -m runtime.launch_server`: tokenizer manager, scheduler,
detokenizer) on 127.0.0.1:`ServerArgs.dp_replica_ports[i]`. sglang-router (the optional `router` extra, a
Rust binary wheel) listens on --host:--port and picks a replica per request by --router-policy; its
`cache_aware` policy keeps an approximate radix tree of the text each replica has seen, so requests that
share a prefix land where that prefix is cached. We do not route anything ourselves: this module starts,
watches and stops the processes, and nothing else.

Supervision contract:
- start-up: every replica answers /health before the router starts, and the router reports all of them as
  healthy workers (/readiness) before the server counts as started; any failure stops everything (exit 1).
- a replica that dies is removed from the router at once (`DELETE /workers/{id}`), so new requests go to the
  others without waiting for the router's own health check; when no replica is left, the server exits 1.
- the router dying makes the server exit 1 (the replicas are stopped).
- SIGTERM drains: it is forwarded to the router and every replica (each finishes its running requests), then
  exit 0. SIGINT or a second SIGTERM stops now: exit 128 + the signal's number.
- every child is started with PDEATHSIG, so even kill -9 of this process leaves no replica or router behind.
- the API keys reach the replicas and the router through their environment, never their command line
  (which `ps` shows every user); the router is started through `router_main` for that.
- every replica learns all the replicas' URLs from RADIXLM_DP_REPLICAS: a replica that takes a LoRA load
  or unload passes it on to the others (`lora_routes.py`), so all serve the same adapters. sglang-router
  does not forward those routes (a 404): an admin sends them to any replica's port.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import requests

from runtime.entrypoints.security import ADMIN_API_KEY_ENV, API_KEY_ENV, KEY_SOURCES
from runtime.managers.child_process import die_with_parent
from runtime.platform import auto_num_threads, free_port
from runtime.server_args import ServerArgs

logger = logging.getLogger("radixlm.dp")

ROUTER_EXTRA_HINT = "--dp-size needs the router extra: pip install 'radixlm[router]'"
STARTUP_TIMEOUT_S = 900.0  # replicas load the model at the same time: slow on a small shared CPU
ROUTER_READY_TIMEOUT_S = 120.0
DRAIN_TIMEOUT_S = 300  # as a single server's SIGTERM drain (launch_server.DRAIN_TIMEOUT_S)
FORCED_STOP_GRACE_S = 5.0
POLL_S = 0.5
# The router's own periodic /health check of each replica. Our watcher notices a dead replica within POLL_S;
# this is the fallback for a replica that hangs without exiting.
ROUTER_HEALTH_INTERVAL_S = 5
# Our levels -> the router's. Its "info" logs two lines per request; ours does not log requests at info.
ROUTER_LOG_LEVELS = {"debug": "debug", "info": "warn", "warning": "warn", "error": "error"}
# Options of the front that replicas do not inherit (each replica is a plain single server on its own port).
_FRONT_ONLY = {
    "host", "port", "dp_size", "dp_base_port", "dp_rank", "router_policy", "num_threads", "allowed_hosts"
}  # fmt: skip
# Never on a command line: the keys go through the environment (`child_env`).
_SECRETS = {"api_key", "api_key_file", "admin_api_key", "admin_api_key_file"}
REPLICAS_ENV = "RADIXLM_DP_REPLICAS"  # the replicas' URLs, comma-separated, in each replica's environment


class RouterNotInstalled(RuntimeError):
    pass


class _Stopped(Exception):
    """A stop signal arrived while starting."""


def check_router_installed() -> None:
    """Raise RouterNotInstalled (naming the extra to install) when sglang-router is missing."""
    if importlib.util.find_spec("sglang_router") is None:
        raise RouterNotInstalled(ROUTER_EXTRA_HINT)


def replica_threads(args: ServerArgs) -> int:
    """Scheduler threads of each replica: --num-threads as given (it is per server), else the CPUs this
    process may use split between the replicas (more threads than CPUs is a 3-7x cliff, see
    `auto_num_threads`)."""
    return args.num_threads or max(1, auto_num_threads() // args.dp_size)


def replica_cli_args(args: ServerArgs, port: int) -> list[str]:
    """`runtime.launch_server` arguments of the replica on `port`: every option the user set, except the
    front's own (host, port, dp options), on 127.0.0.1, with its data-parallel rank (its KV events' rank and
    endpoint ports, `kv_events.replica_endpoint`)."""
    rank = port - args.dp_replica_ports[0]
    out = ["--host", "127.0.0.1", "--port", str(port), "--num-threads", str(replica_threads(args))]
    out += ["--dp-rank", str(rank)]
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        if f.name in _FRONT_ONLY or f.name in _SECRETS or value == f.default:
            continue
        if not f.metadata.get("cli", True):  # set by resolve(), which each replica runs itself
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):  # every bool option defaults to False: a set one is a bare flag
            out.append(flag)
        elif isinstance(value, tuple):  # a list of words (nargs="*"), e.g. --lora-modules a=PATH b=PATH
            out += [flag, *value]
        else:
            out += [flag, str(value)]
    return out


def router_cli_args(args: ServerArgs, worker_urls: list[str], prometheus_port: int) -> list[str]:
    """`python -m sglang_router.launch_router` arguments (see its --help)."""
    out = [
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--worker-urls",
        *worker_urls,
        "--policy",
        args.router_policy,
        # Its metrics server binds 0.0.0.0:29000 unless told otherwise.
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(prometheus_port),
        "--health-check-interval-secs",
        str(ROUTER_HEALTH_INTERVAL_S),
        "--shutdown-grace-period-secs",
        str(DRAIN_TIMEOUT_S),
        "--max-payload-size",
        str(args.max_request_bytes),
        "--log-level",
        ROUTER_LOG_LEVELS[args.log_level],
    ]
    return out  # the router's --api-key is added by `router_main`, from its environment


def replica_urls(args: ServerArgs) -> list[str]:
    return [f"http://127.0.0.1:{port}" for port in args.dp_replica_ports]


def child_env(args: ServerArgs, router: bool = False) -> dict[str, str]:
    """This process's environment with the keys a replica (or, `router`, the router: the API key only)
    must have, and without those it must not; a replica's also lists every replica (REPLICAS_ENV)."""
    env = dict(os.environ)
    if router:
        env.pop(REPLICAS_ENV, None)
    else:
        env[REPLICAS_ENV] = ",".join(replica_urls(args))
    for name, var in KEY_SOURCES:
        value = getattr(args, name)
        if value is None or (router and var == ADMIN_API_KEY_ENV):
            env.pop(var, None)
        else:
            env[var] = value
    return env


def router_main(argv: list[str]) -> None:
    """`python -m runtime.entrypoints.data_parallel ROUTER-ARGS`: sglang-router's launcher, given --api-key
    from RADIXLM_API_KEY in-process so that the key is in no command line.

    The router checks the key on every client request and sends it to the replicas."""
    from sglang_router.launch_router import launch_router, parse_router_args

    key = os.environ.pop(API_KEY_ENV, None)
    launch_router(parse_router_args(argv + (["--api-key", key] if key else [])))


def local_url(host: str, port: int) -> str:
    """URL to reach a server bound to `host` from this machine."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def check_ports_free(args: ServerArgs) -> None:
    """Raise RuntimeError naming the first port (public or replica) that cannot be bound."""
    wanted = [(args.host, args.port, "--port")] + [
        ("127.0.0.1", p, f"replica {i} (--dp-base-port)") for i, p in enumerate(args.dp_replica_ports)
    ]
    for host, port, what in wanted:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError as e:
                raise RuntimeError(f"port {port} of {what} is not free on {host}: {e.strerror}") from None


def _spawn(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    # die_with_parent in the child, between fork and exec: no orphan even after kill -9 of this process.
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env=env, preexec_fn=die_with_parent)


class DataParallelServer:
    """Starts N replicas and the router, watches them, and stops them (see the module docstring)."""

    def __init__(self, args: ServerArgs):
        self.args = args
        self.router_url = local_url(args.host, args.port)
        self.replicas: dict[str, subprocess.Popen] = {}  # replica URL -> process, while it runs
        self.router: subprocess.Popen | None = None
        self.signals: list[int] = []
        self.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    def run(self) -> int:
        """Serve until stopped; the exit code (0 after a SIGTERM drain)."""
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            try:
                check_ports_free(self.args)
                self._start()
            except _Stopped:
                return 128 + self.signals[0]
            except RuntimeError as e:
                logger.error("%s", e)
                return 1
            return self._watch()
        finally:
            self._kill_all()
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _on_signal(self, sig: int, frame) -> None:
        self.signals.append(sig)

    # ---- start-up ---------------------------------------------------------------------------------------
    def _start(self) -> None:
        args = self.args
        for port, url in zip(args.dp_replica_ports, replica_urls(args)):
            cmd = [sys.executable, "-m", "runtime.launch_server", *replica_cli_args(args, port)]
            self.replicas[url] = _spawn(cmd, child_env(args))
        logger.info(
            "starting %d replicas on 127.0.0.1 ports %d..%d (%d threads each)",
            args.dp_size,
            args.dp_replica_ports[0],
            args.dp_replica_ports[-1],
            replica_threads(args),
        )
        self._wait_until(STARTUP_TIMEOUT_S, "replicas healthy", self._replicas_healthy)
        prometheus_port = free_port()
        router_args = router_cli_args(args, list(self.replicas), prometheus_port)
        cmd = [sys.executable, "-m", "runtime.entrypoints.data_parallel", *router_args]
        self.router = _spawn(cmd, child_env(args, router=True))
        self._wait_until(ROUTER_READY_TIMEOUT_S, "router ready", self._router_ready)
        logger.info(
            "serving %s on %s: sglang-router (policy %s, metrics on 127.0.0.1:%d) over %d replicas",
            args.model_name,
            self.router_url,
            args.router_policy,
            prometheus_port,
            args.dp_size,
        )

    def _wait_until(self, timeout_s: float, what: str, ready) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if self.signals:
                raise _Stopped
            self._check_started_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"start-up failed: not {what} within {timeout_s:g}s")
            time.sleep(POLL_S)

    def _check_started_alive(self) -> None:
        for url, proc in self.replicas.items():
            if proc.poll() is not None:
                raise RuntimeError(f"start-up failed: replica {url} exited with code {proc.returncode}")
        if self.router is not None and self.router.poll() is not None:
            raise RuntimeError(f"start-up failed: sglang-router exited with code {self.router.returncode}")

    def _replicas_healthy(self) -> bool:
        return all(self._get(url + "/health") is not None for url in self.replicas)

    def _router_ready(self) -> bool:
        """The router answers /readiness with every replica registered and healthy."""
        r = self._get(self.router_url + "/readiness")
        try:
            return r is not None and r.json().get("healthy_workers") == len(self.replicas)
        except ValueError:  # not JSON: not sglang-router's answer (yet)
            return False

    def _get(self, url: str) -> requests.Response | None:
        """The response when it is a 200, else None."""
        try:
            r = requests.get(url, headers=self.headers, timeout=5)
        except requests.RequestException:
            return None
        return r if r.status_code == 200 else None

    # ---- running ----------------------------------------------------------------------------------------
    def _watch(self) -> int:
        assert self.router is not None
        while not self.signals:
            if self.router.poll() is not None:
                code = self.router.returncode
                logger.error("sglang-router exited with code %s: stopping the replicas", code)
                return 1
            for url, proc in list(self.replicas.items()):
                if proc.poll() is None:
                    continue
                del self.replicas[url]
                logger.error(
                    "replica %s exited with code %s; routing to the %d other(s)",
                    url,
                    proc.returncode,
                    len(self.replicas),
                )
                self._remove_worker(url)
            if not self.replicas:
                logger.error("no replica left: exiting")
                return 1
            time.sleep(POLL_S)
        return self._shutdown()

    def _remove_worker(self, url: str) -> None:
        """Take a dead replica out of the router's worker list (its health check would take seconds)."""
        try:
            r = requests.get(self.router_url + "/workers", headers=self.headers, timeout=5)
            r.raise_for_status()
            for worker in r.json().get("workers", []):
                if worker.get("url") == url:
                    d = requests.delete(
                        f"{self.router_url}/workers/{worker['id']}", headers=self.headers, timeout=5
                    )
                    d.raise_for_status()
        except (requests.RequestException, ValueError, KeyError) as e:
            logger.warning(
                "could not remove %s from the router (%s); its health check will, within ~%ds",
                url,
                e,
                3 * ROUTER_HEALTH_INTERVAL_S,
            )

    # ---- shutdown ---------------------------------------------------------------------------------------
    def _children(self) -> list[subprocess.Popen]:
        return [p for p in (self.router, *self.replicas.values()) if p is not None and p.poll() is None]

    def _signal_all(self, sig: int) -> None:
        for proc in self._children():
            proc.send_signal(sig)

    def _shutdown(self) -> int:
        """SIGTERM: drain every child (up to DRAIN_TIMEOUT_S); anything else, or a second signal: stop now."""
        forced = self.signals[0] != signal.SIGTERM
        handled = 1
        logger.info("%s: %s", signal.Signals(self.signals[0]).name, "stopping now" if forced else "draining")
        self._signal_all(signal.SIGINT if forced else signal.SIGTERM)
        deadline = time.monotonic() + (FORCED_STOP_GRACE_S if forced else DRAIN_TIMEOUT_S + 10)
        while self._children() and time.monotonic() < deadline:
            if len(self.signals) > handled:
                handled = len(self.signals)
                if not forced:
                    forced = True
                    logger.warning("%s: stopping now", signal.Signals(self.signals[-1]).name)
                    self._signal_all(signal.SIGINT)
                    deadline = time.monotonic() + FORCED_STOP_GRACE_S
            time.sleep(0.1)
        self._kill_all()
        return 128 + self.signals[-1] if forced else 0

    def _kill_all(self) -> None:
        """SIGKILL and reap whatever still runs (idempotent)."""
        procs = [p for p in (self.router, *self.replicas.values()) if p is not None]
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                logger.error("child %d did not exit after SIGKILL", proc.pid)


def run_data_parallel(args: ServerArgs) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s [dp] %(levelname)s %(name)s: %(message)s"
    )
    try:
        check_router_installed()
    except RouterNotInstalled as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.quantization == "auto":  # a folder's measurement runs once, here; the replicas read its cache
        from runtime.model_executor.quant_probe import auto_quantization

        logger.info("--quantization auto: %s", args.resolve(probe=auto_quantization).quantization_reason)
    logger.warning(
        "--dp-size: sglang-router serves %s:%d and does not check the Host header (no DNS-rebinding "
        "protection there)%s",
        args.host,
        args.port,
        "; it forwards /flush_cache with --api-key, which the replicas refuse as not the admin key"
        if args.admin_api_key
        else "",
    )
    return DataParallelServer(args).run()


if __name__ == "__main__":
    router_main(sys.argv[1:])
