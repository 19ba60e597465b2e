"""The `radixlm` command."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="radixlm", description="radixlm: agent-oriented LLM serving runtime"
    )
    parser.add_argument(
        "command", choices=["serve"], help="serve: start the HTTP server (see radixlm serve -h)"
    )
    if not argv or argv[0] not in ("serve",):
        parser.parse_args(argv[:1])
    from runtime.launch_server import parse_args, run_server

    sys.exit(run_server(parse_args(argv[1:])))


if __name__ == "__main__":
    main()
