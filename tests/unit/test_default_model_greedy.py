"""The default model (SmolLM2-135M-Instruct) through our scheduler + runner continues chat prompts exactly as
transformers' greedy `generate` does on the same converted weights."""

from __future__ import annotations

import pytest
import torch

from runtime.managers.scheduler.scheduler import Scheduler
from runtime.messages import GenerateReq
from runtime.sampling_params import SamplingParams
from runtime.server_args import ServerArgs

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a radix tree is in one sentence.",
    "List three prime numbers.",
]


@pytest.fixture(scope="module")
def prompts(default_tokenizer):
    return [
        default_tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q in QUESTIONS
    ]


def test_greedy_32_tokens_match_transformers(default_model_dir, default_tokenizer, prompts):
    from transformers import AutoModelForCausalLM

    args = ServerArgs(  # float32 explicitly: `auto` is bfloat16 or w4a8 on some CPUs
        model=default_model_dir,
        dtype="float32",
        quantization="none",
        kv_cache_dtype="float32",
        max_total_tokens=4096,
        log_interval=0,
        attention_backend="torch_native",
    )
    sched = Scheduler(args, default_model_dir, tokenizer=default_tokenizer)
    ids = [default_tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    for i, toks in enumerate(ids):  # one batch: mixed prompt lengths decode together
        sched.handle(
            GenerateReq(
                rid=str(i),
                input_ids=toks,
                params=SamplingParams(max_new_tokens=32, min_new_tokens=32, temperature=0.0),
            )
        )  # EOS banned, as HF min_new_tokens
    outs: dict[str, list[int]] = {}
    while sched.has_work():
        for o in sched.step():
            outs.setdefault(o.rid, []).extend(o.new_token_ids)
    sched.check_accounting()

    from runtime.models.gguf import float_folder

    hf = AutoModelForCausalLM.from_pretrained(float_folder(default_model_dir), dtype=torch.float32).eval()
    for i, toks in enumerate(ids):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([toks]),
                max_new_tokens=32,
                min_new_tokens=32,
                do_sample=False,
                pad_token_id=default_tokenizer.eos_token_id,
            )[0, len(toks) :].tolist()
        assert outs[str(i)] == ref, (
            f"prompt {i}: {default_tokenizer.decode(outs[str(i)])!r} != {default_tokenizer.decode(ref)!r}"
        )
    assert "Paris" in default_tokenizer.decode(outs["0"])
