#!/usr/bin/env bash
# Talk to a running radixlm server with curl: native /generate (plain, streamed, JSON-Schema constrained),
# model info, and the OpenAI-compatible chat endpoint.
#
#   bash examples/client_curl.sh --url http://127.0.0.1:30000 [--api-key KEY]
set -euo pipefail

URL="http://127.0.0.1:30000"
API_KEY=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --url) URL="$2"; shift 2 ;;
    --api-key) API_KEY="$2"; shift 2 ;;
    -h|--help) sed -n '2,6p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
AUTH=()
if [[ -n "$API_KEY" ]]; then AUTH=(-H "Authorization: Bearer $API_KEY"); fi
post() { curl -sS --fail-with-body "${AUTH[@]}" -H "Content-Type: application/json" "$URL$1" -d "$2"; echo; }

echo "== GET /health"
curl -sS --fail-with-body "$URL/health"; echo

echo "== GET /get_model_info"
curl -sS --fail-with-body "${AUTH[@]}" "$URL/get_model_info"; echo

echo "== POST /generate (greedy)"
post /generate '{"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}'

echo "== POST /generate (streamed, SSE: cumulative text per chunk, then [DONE])"
curl -sS -N --fail-with-body "${AUTH[@]}" -H "Content-Type: application/json" "$URL/generate" \
  -d '{"text": "Count to five: one,", "stream": true, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}'
echo

echo "== POST /generate (JSON Schema)"
post /generate '{"text": "A person as JSON: ", "sampling_params": {"max_new_tokens": 16, "temperature": 0,
  "json_schema": "{\"type\": \"object\", \"properties\": {\"age\": {\"type\": \"integer\"}}, \"required\": [\"age\"]}"}}'

echo "== POST /v1/chat/completions"
MODEL=$(curl -sS --fail-with-body "${AUTH[@]}" "$URL/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
post /v1/chat/completions "{\"model\": \"$MODEL\", \"max_tokens\": 8, \"temperature\": 0,
  \"messages\": [{\"role\": \"user\", \"content\": \"Say hello in French.\"}]}"
