#!/usr/bin/env bash
# NVIDIA Dynamo's frontend and Python bindings in .peers/dynamo-venv, for bench.kv_router's dynamo-kv side.
#
# `pip install ai-dynamo` fails without pypi.nvidia.com: it requires `aisimulate`, whose PyPI package is a
# placeholder that downloads the real wheel from there at install time (the planner's simulator; the
# frontend and the KV router do not import it). So: the runtime wheel with its dependencies, `ai-dynamo`
# without its dependencies, then its other dependencies. About 700 MB; CPU only.
#
#     bash bench/dynamo_venv.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.peers/dynamo-venv
VERSION=1.6.1
test -x "$VENV/bin/python" || python3 -m venv "$VENV"
"$VENV/bin/pip" install -q "ai-dynamo-runtime==$VERSION"
"$VENV/bin/pip" install -q --no-deps "ai-dynamo==$VERSION"
"$VENV/bin/pip" install -q 'aiohttp>=3.14.3,<4.0' 'certifi>=2026.10.19' 'kubernetes>=32.0.1,<33.0.0' \
    'msgspec>=0.19.0' 'prometheus-client>=0.23.1,<1.0' 'pyzmq>=26.0.0' 'redis>=6.2.0,<9.0.0' tqdm \
    'transformers>=4.56.0' 'zstandard>=0.23.0,<1.0' packaging uvloop
"$VENV/bin/python" -c "import dynamo.frontend, dynamo.llm; print('dynamo', '$VERSION', 'in $VENV')"
