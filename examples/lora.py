"""Two LoRA adapters on one server, each queried through the official `openai` client by its name in `model`.

Starts `radixlm serve --lora-modules tenant-a=PATH tenant-b=PATH` on a free port (two demo adapters with
random weights are written first unless `--adapters` names real PEFT folders), lists /v1/models (the base and
both adapters, each with its `parent`), asks the same question of the base model and of each adapter, asks
again to show each adapter's own prefix cache (`cached_tokens`), then stops the server.

    python examples/lora.py
    python examples/lora.py --adapters tenant-a=/path/to/peft_a tenant-b=/path/to/peft_b
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import openai
import requests


def demo_adapters(out: Path) -> list[str]:
    """Two random rank-8 PEFT adapters on every projection of the default model: NAME=PATH entries."""
    import torch
    from safetensors.torch import save_file

    from runtime.models.lora import projection_shapes
    from runtime.models.model_config import ModelConfig
    from runtime.models.model_loader import load_hf_config, resolve_model_path

    cfg = ModelConfig.from_hf(load_hf_config(resolve_model_path("default")))
    specs = []
    for k, name in enumerate(("tenant-a", "tenant-b")):
        g = torch.Generator().manual_seed(k)
        tensors = {}
        for layer in range(cfg.num_layers):
            for target, (fan_in, fan_out) in projection_shapes(cfg).items():
                group = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
                key = f"base_model.model.model.layers.{layer}.{group}.{target}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(8, fan_in, generator=g) * 0.05
                tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, 8, generator=g) * 0.05
        folder = out / name
        folder.mkdir()
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        config = {
            "peft_type": "LORA",
            "r": 8,
            "lora_alpha": 16,
            "target_modules": list(projection_shapes(cfg)),
        }
        (folder / "adapter_config.json").write_text(json.dumps(config))
        specs.append(f"{name}={folder}")
    return specs


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--adapters", nargs="*", help="NAME=PATH of PEFT adapters (default: two random demo ones)")
    p.add_argument("--question", default="Name three colours of the rainbow.")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="radixlm-lora-example-") as tmp:
        specs = a.adapters or demo_adapters(Path(tmp))
        port = free_port()
        cmd = [sys.executable, "-m", "runtime.launch_server", "--port", str(port), "--lora-modules", *specs]
        server = subprocess.Popen(cmd)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 300
            while True:
                try:
                    if requests.get(url + "/health", timeout=2).status_code == 200:
                        break
                except requests.ConnectionError:
                    pass
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("the server did not start")
                time.sleep(0.5)
            client = openai.OpenAI(base_url=url + "/v1", api_key="none")
            models = client.models.list().data
            for m in models:
                print(f"model {m.id!r}" + (f" (LoRA of {m.parent!r})" if getattr(m, "parent", None) else ""))
            messages = [{"role": "user", "content": a.question}]
            for round_ in ("first", "again"):
                for m in models:
                    r = client.chat.completions.create(
                        model=m.id, messages=messages, max_tokens=24, temperature=0
                    )
                    details = r.usage.prompt_tokens_details
                    cached = details.cached_tokens if details is not None else 0
                    print(
                        f"[{round_}] {m.id}: cached {cached} prompt tokens: {r.choices[0].message.content!r}"
                    )
        finally:
            server.terminate()
            server.wait(timeout=60)


if __name__ == "__main__":
    main()
