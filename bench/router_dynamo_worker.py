"""radixlm replicas as one NVIDIA Dynamo worker with a data-parallel rank per replica: registers the model
with Dynamo's discovery (token input, chat and completions, `data_parallel_size` = the replica count),
answers the frontend's preprocessed requests by forwarding their token ids to the native `/generate` of the
replica whose rank the router chose, and relays each replica's `--kv-events-config` ZMQ stream (vLLM's wire
format) to Dynamo's KV router with Dynamo's own `KvEventPublisher` in ZMQ-relay mode, one per rank: the
layout of Dynamo's vLLM worker over a data-parallel vLLM engine.

Runs in the environment that has the `ai-dynamo` wheel (`.peers/dynamo-venv`), not radixlm's: it imports
nothing from radixlm. `bench.kv_router`'s `dynamo-kv` side starts it.

    .peers/dynamo-venv/bin/python bench/router_dynamo_worker.py --model-path MODEL_DIR \\
        --replica http://127.0.0.1:30001=tcp://127.0.0.1:5557 --replica http://127.0.0.1:30002=tcp://127.0.0.1:5558

Dynamo's discovery is `file` (a folder, `DYN_FILE_KV`) and its event plane ZMQ, so neither etcd nor NATS
runs.
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def generate_body(request: dict[str, Any], default_max_tokens: int = 256) -> dict[str, Any]:
    """radixlm's `/generate` body for Dynamo's preprocessed request (token ids, `stop_conditions`,
    `sampling_options` with its `guided_decoding`)."""
    token_ids = request.get("token_ids")
    if not isinstance(token_ids, list) or not token_ids:
        raise ValueError("preprocessed request: token_ids must be a non-empty list")
    stop = request.get("stop_conditions") or {}
    opts = request.get("sampling_options") or {}
    sampling: dict[str, Any] = {
        "max_new_tokens": stop.get("max_tokens") or default_max_tokens,
        "temperature": opts.get("temperature") if opts.get("temperature") is not None else 1.0,
    }
    for key in ("top_p", "top_k", "seed", "frequency_penalty", "presence_penalty"):
        if opts.get(key) is not None:
            sampling[key] = opts[key]
    if stop.get("stop"):
        sampling["stop"] = stop["stop"]
    if stop.get("ignore_eos"):
        sampling["ignore_eos"] = True
    guided = opts.get("guided_decoding") or {}
    if guided.get("regex"):
        sampling["regex"] = guided["regex"]
    elif guided.get("json") is not None:
        sampling["json_schema"] = json.dumps(guided["json"])
    elif guided.get("grammar") or guided.get("choice") or guided.get("structural_tag"):
        raise ValueError(f"guided decoding: radixlm takes a regex or a JSON schema, not {sorted(guided)}")
    return {"input_ids": token_ids, "sampling_params": sampling}


def replica_rank(request: dict[str, Any], num_replicas: int) -> int:
    """The data-parallel rank Dynamo's router chose for the request (`routing.dp_rank`); 0 if none."""
    rank = (request.get("routing") or {}).get("dp_rank")
    if rank is None:
        return 0
    if not isinstance(rank, int) or not 0 <= rank < num_replicas:
        raise ValueError(f"routing.dp_rank {rank!r} is not a rank of the {num_replicas} replicas")
    return rank


def parse_replica(text: str) -> tuple[str, str]:
    """`--replica URL=ENDPOINT` -> (url without a trailing slash, ZMQ endpoint)."""
    url, sep, endpoint = text.partition("=")
    if not sep or not url.startswith("http") or "://" not in endpoint:
        raise ValueError(f"--replica {text!r}: expected HTTP_URL=ZMQ_ENDPOINT (http://h:p=tcp://h:p)")
    return url.rstrip("/"), endpoint


def engine_output(answer: dict[str, Any], prompt_len: int) -> dict[str, Any]:
    """Dynamo's engine output (token ids, finish reason, usage with cached tokens) for radixlm's answer."""
    meta = answer.get("meta_info") or {}
    ids = list(answer.get("output_ids") or [])
    finish = (meta.get("finish_reason") or {}).get("type") or "stop"
    prompt = meta.get("prompt_tokens", prompt_len)
    return {
        "token_ids": ids,
        "finish_reason": "length" if finish == "length" else "stop",
        "completion_usage": {
            "prompt_tokens": prompt,
            "completion_tokens": len(ids),
            "total_tokens": prompt + len(ids),
            "prompt_tokens_details": {"cached_tokens": meta.get("cached_tokens", 0)},
        },
    }


async def serve(args: argparse.Namespace) -> None:
    import asyncio

    import aiohttp
    from dynamo.llm import (
        KvEventPublisher,
        ModelInput,
        ModelRuntimeConfig,
        ModelType,
        WorkerType,
        register_model,
    )
    from dynamo.runtime import DistributedRuntime

    replicas = [parse_replica(r) for r in args.replica]
    loop = asyncio.get_running_loop()
    runtime = DistributedRuntime(loop, "file", "tcp", event_plane="zmq")
    endpoint = runtime.endpoint(f"{args.namespace}.backend.generate")
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600))

    async def generate(request: dict[str, Any], context: Any = None):
        url = replicas[replica_rank(request, len(replicas))][0]
        body = generate_body(request)
        async with session.post(url + "/generate", json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"replica {url} answered HTTP {r.status}: {(await r.text())[:200]}")
            answer = await r.json()
        yield engine_output(answer, len(body["input_ids"]))

    config = ModelRuntimeConfig()
    config.data_parallel_size = len(replicas)
    config.data_parallel_start_rank = 0
    config.kv_event_publishing_enabled = True
    await register_model(
        ModelInput.Tokens,
        ModelType.Chat | ModelType.Completions,
        endpoint,
        args.model_path,
        args.model_name,
        worker_type=WorkerType.Aggregated,
        kv_cache_block_size=args.block_size,
        runtime_config=config,
    )
    publishers = [
        KvEventPublisher(
            endpoint=endpoint, kv_block_size=args.block_size, dp_rank=rank, zmq_endpoint=events, zmq_topic=""
        )
        for rank, (_, events) in enumerate(replicas)
    ]
    try:
        await endpoint.serve_endpoint(generate)
    finally:
        for pub in publishers:
            pub.shutdown()
        await session.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--replica",
        action="append",
        required=True,
        help="HTTP_URL=ZMQ_ENDPOINT of one replica (its KV-event PUB socket), in rank order; one per replica",
    )
    p.add_argument("--model-path", required=True, help="the model folder (tokenizer, chat template, config)")
    p.add_argument("--model-name", default="default", help="model name the frontend serves")
    p.add_argument("--block-size", type=int, default=16, help="--kv-events-block-size of the replicas")
    p.add_argument("--namespace", default="radixlm", help="Dynamo namespace")
    args = p.parse_args(argv)
    for r in args.replica:
        parse_replica(r)  # a bad value stops here, before Dynamo starts
    import uvloop

    uvloop.run(serve(args))


if __name__ == "__main__":
    main()
