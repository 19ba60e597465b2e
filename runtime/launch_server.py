"""`python -m runtime.launch_server` / `radixlm serve`: load the model, start the trio, serve HTTP.

Signals: SIGTERM drains (new requests get 503, running ones finish, then exit 0); a second SIGTERM or
SIGINT stops at once (running requests get 503, exit code 128 + the signal's number). If the scheduler or
detokenizer (or a tensor-parallel rank) dies, the server exits non-zero so a supervisor restarts it.
`--dp-size N` runs N such servers behind sglang-router instead (`runtime.entrypoints.data_parallel`).

With `--nnodes N --node-rank K` (K > 0) this node serves no HTTP: it runs its share of the tensor-parallel
ranks until one dies (exit 1) or it is signalled (exit 0); node 0 runs the server and rank 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

import uvicorn

from runtime.server_args import ServerArgs

logger = logging.getLogger("radixlm.launch")
DRAIN_TIMEOUT_S = 300
FORCED_STOP_GRACE_S = 3.0  # after a forced stop, how long the failed requests get to send their 503


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, tm):
        super().__init__(config)
        self.tm = tm
        self.stopped_by: int | None = None  # the signal that forced an immediate stop

    def handle_exit(self, sig: int, frame) -> None:
        if sig == signal.SIGTERM and not self.tm.draining:
            logger.info(
                "SIGTERM: draining %d in-flight request(s); new requests get 503", self.tm.num_in_flight()
            )
            self.tm.draining = True
            asyncio.get_event_loop().create_task(self._drain())
            return
        # Not uvicorn's handle_exit: it only sets should_exit, and its shutdown then waits, without a timeout,
        # for every open connection (a running request) to finish. It would also re-raise the signal after
        # serve(), killing the process before TokenizerManager.shutdown() stops the children.
        if self.stopped_by is not None:  # yet another signal: do not even wait for the error responses
            self.force_exit = True
            return
        name = signal.Signals(sig).name
        logger.warning("%s: stopping now, failing %d in-flight request(s)", name, self.tm.num_in_flight())
        self.tm.draining = True
        self.stopped_by = sig
        self.should_exit = True
        # A signal handler interrupts the loop at an arbitrary point: touch its state from a callback.
        asyncio.get_event_loop().call_soon_threadsafe(self._stop_now)

    def _stop_now(self) -> None:
        """Answer every running request with a 503 so their connections close and shutdown completes at once;
        whatever still holds a connection after FORCED_STOP_GRACE_S is cut."""
        name = signal.Signals(self.stopped_by).name
        self.tm.fail_in_flight(f"server is shutting down ({name}): request abandoned")
        asyncio.get_running_loop().call_later(FORCED_STOP_GRACE_S, setattr, self, "force_exit", True)

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DRAIN_TIMEOUT_S
        while self.tm.num_in_flight() and loop.time() < deadline:
            await asyncio.sleep(0.1)
        self.should_exit = True


def parse_args(argv: list[str] | None = None, prog: str = "radixlm serve") -> ServerArgs:
    """The options, with the API keys read from their files or environment variables (which are then
    removed from this process's environment, so its children never see them)."""
    from runtime.entrypoints.security import load_keys

    parser = argparse.ArgumentParser(prog=prog, description="Serve a model over HTTP (native + OpenAI API).")
    ServerArgs.add_cli_args(parser)
    try:
        return load_keys(ServerArgs.from_cli_args(parser.parse_args(argv)))
    except ValueError as e:
        parser.error(str(e))
        raise


def run_server(args: ServerArgs) -> int:
    if args.dp_size > 1:  # N replicas of this very function behind sglang-router
        from runtime.entrypoints.data_parallel import run_data_parallel

        return run_data_parallel(args)
    from runtime.entrypoints.security import allowed_hosts
    from runtime.entrypoints.server import create_app
    from runtime.managers.tokenizer.tokenizer_manager import TokenizerManager
    from runtime.model_executor.quant_probe import auto_quantization
    from runtime.models.model_loader import resolve_model_path

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s [server] %(levelname)s %(name)s: %(message)s"
    )
    try:
        args = args.resolve(probe=auto_quantization)  # the ranks and the scheduler receive its choice
        logger.info(
            "--quantization %s --dtype %s: %s", args.quantization, args.dtype, args.quantization_reason
        )
        model_dir = resolve_model_path(args.model)
    except (
        ValueError
    ) as e:  # a model that cannot be served (a truncated GGUF file, say): why, not a traceback
        logger.error("--model %s cannot be served: %s", args.model, e)
        return 1
    if args.node_rank > 0:
        return run_worker_node(args, model_dir)
    if args.allowed_hosts is None and allowed_hosts(args) is None:
        logger.warning(
            "--host %s: any Host header is accepted, so a web page can reach this server by DNS rebinding; "
            "set --allowed-hosts to the names clients use",
            args.host or "''",
        )
    state = {"dead": None}
    server_box: list[_Server] = []

    def on_child_death(reason: str) -> None:
        state["dead"] = reason
        if server_box:
            server_box[0].should_exit = True

    tm = TokenizerManager(args, model_dir, on_child_death=on_child_death)
    try:
        app = create_app(tm, args)
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_keep_alive=5,
            access_log=args.log_level == "debug",
        )
        server = _Server(config, tm)
        server_box.append(server)

        async def serve():
            tm.start()
            logger.info(
                "serving %s on http://%s:%d (context %d, KV pool %d tokens, backend %s)",
                args.model_name,
                args.host,
                args.port,
                tm.context_length,
                tm.info["max_total_tokens"],
                tm.info["attention_backend"],
            )
            await server.serve()

        asyncio.run(serve())
    finally:
        tm.shutdown()
    if state["dead"]:
        logger.error("exiting: %s", state["dead"])
        return 1
    if server_box and server_box[0].stopped_by is not None:
        return 128 + server_box[0].stopped_by  # the shell's code for "ended by this signal"
    return 0


def run_worker_node(args: ServerArgs, model_dir: str) -> int:
    """Run this node's tensor-parallel ranks (no HTTP) until one dies or a signal arrives."""
    import threading

    from runtime.managers.tokenizer.supervisor import WATCH_INTERVAL_S, Supervisor

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    sup = Supervisor(args, model_dir, endpoints=None)
    try:
        sup.start(frontend=False)
        logger.info(
            "node %d/%d: tensor-parallel ranks %s joined %s",
            args.node_rank,
            args.nnodes,
            list(args.tp_ranks_here),
            args.dist_init_addr,
        )
        while not stop.wait(WATCH_INTERVAL_S):
            if (reason := sup.dead_child()) is not None:
                logger.error("exiting: %s", reason)
                return 1
        return 0
    finally:
        sup.stop()


def main(argv: list[str] | None = None) -> None:
    sys.exit(run_server(parse_args(argv, prog="python -m runtime.launch_server")))


if __name__ == "__main__":
    main()
