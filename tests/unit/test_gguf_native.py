"""A GGUF file served from its own blocks (`--quantization gguf_native`, runtime/models/gguf_model.py):
whole tiny models of each architecture, written by the test (tests/unit/test_gguf_architectures.py's
writer), against the float32 model of the same weights (gguf-py's dequantization of the file), and the
default resolution."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from runtime.models import model_loader as ml
from runtime.models.gguf_linear import GGUFLinear
from tests.unit.test_gguf_architectures import (
    CONFIGS,
    PROMPTS,
    VOCAB,
    hf_logits,
    runner_for,
    served_logits,
    tiny_model,
    with_weights,
    write_gguf,
)

# what llama.cpp's Q4_K_M recipe gives a small model: Q4_K, with attn_v, ffn_down and the head in Q6_K
Q4_K_M = {"attn_v.weight": Q.Q6_K, "ffn_down.weight": Q.Q6_K, "output.weight": Q.Q6_K}
MIN_AGREEMENT = 0.99  # next-token top-1 agreement with float32 (issue 49's bound)
# These tiny random models have flat logits (std ~0.3): where float32's top two are closer than a tenth of
# that, int8 activations' ~1.5% error may pick either, so such near-ties are left out of the bound (and the
# raw agreement, ties included, must still be >= 0.9).
TIE = 0.1


def native_runner(tmp_path: Path, name: str):
    folder = ml.resolve_model_path(str(tmp_path / name), str(tmp_path / "cache"))
    assert not list(Path(folder).glob("*.safetensors"))  # no float copy of the weights is written
    return runner_for(folder, quantization="gguf_native")


# longer prompts than the architecture tests' (154 positions): the bound is over enough choices
LONG = [np.random.default_rng(i).integers(3, VOCAB, n).tolist() for i, n in enumerate((40, 64, 50))]


def agreement(ours: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """Top-1 agreement over the positions where float32's choice is not a near-tie (see TIE); asserts the
    raw agreement too."""
    a, b = torch.cat(ours), torch.cat(ref)
    same = a.argmax(-1) == b.argmax(-1)
    assert same.float().mean() >= 0.9, f"raw top-1 agreement {same.float().mean():.3f}"
    top2 = b.topk(2, -1).values
    decided = top2[:, 0] - top2[:, 1] >= TIE * b.std()
    assert decided.float().mean() >= 0.6  # the bound is not left to a handful of positions
    return same[decided].float().mean().item()


@pytest.mark.slow  # builds and compares whole models
@pytest.mark.parametrize("kind", sorted(CONFIGS))
@pytest.mark.parametrize("mix", ["Q8_0", "Q4_K_M"])
def test_native_gguf_agrees_with_float32(tmp_path: Path, kind: str, mix: str) -> None:
    model = tiny_model(kind, hidden_size=256, intermediate_size=512)
    qtype, types = (Q.Q8_0, None) if mix == "Q8_0" else (Q.Q4_K, Q4_K_M)
    encoded = write_gguf(tmp_path / "m.gguf", model, kind, qtype=qtype, types=types)
    runner = native_runner(tmp_path, "m.gguf")
    layers = [m for m in runner.model.modules() if isinstance(m, GGUFLinear)]
    assert len(layers) == 4 * 2 + 1  # every projection and the head read the file's blocks
    if mix == "Q4_K_M":
        assert {m.kind for m in layers} >= {"Q4_K", "Q6_K", "Q4_K+Q6_K"}
    ours, ref = served_logits(runner, LONG), hf_logits(with_weights(model, encoded), LONG)
    agree = agreement(ours, ref)
    assert agree >= MIN_AGREEMENT, f"top-1 agreement {agree:.3f}"
    # only the activations' int8 rounding apart: a few percent of the logits' spread
    for got, want in zip(ours, ref, strict=True):
        assert (got - want).norm() / want.norm() < 0.05


def mapped(t: torch.Tensor, path: Path) -> bool:
    """Whether `t`'s memory lies in a mapping of the file `path` (/proc/self/maps)."""
    ptr = t.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[5] == str(path.resolve()):
            lo, hi = (int(v, 16) for v in fields[0].split("-"))
            if lo <= ptr < hi:
                return True
    return False


def test_native_blocks_are_the_files_bytes(tmp_path: Path) -> None:
    """Rows that need no reordering are the memory-mapped file's bytes (no copy); llama's Q/K rows are copies
    in Hugging Face's order (a wrong order would change the logits: checked above)."""
    import gguf

    write_gguf(tmp_path / "m.gguf", tiny_model("mistral"), "mistral", qtype=Q.Q8_0)
    runner = native_runner(tmp_path, "m.gguf")
    tensors = {x.name: x for x in gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors}
    down, qkv = runner.model.layers[0].mlp.down_proj, runner.model.layers[0].self_attn.qkv_proj
    f = tmp_path / "m.gguf"
    assert mapped(down.w0, f) and mapped(qkv.w2, f) and not mapped(qkv.w0, f) and not mapped(qkv.w1, f)
    assert np.array_equal(
        down.w0.numpy(), np.asarray(tensors["blk.0.ffn_down.weight"].data).reshape(down.w0.shape)
    )
    q = np.asarray(tensors["blk.0.attn_q.weight"].data)
    assert not np.array_equal(qkv.w0.numpy(), q) and np.array_equal(np.sort(qkv.w0.numpy(), 0), np.sort(q, 0))


def test_auto_picks_native_for_a_gguf_file(tmp_path: Path) -> None:
    from runtime.models.gguf_linear import kernel_isa
    from runtime.server_args import ServerArgs

    write_gguf(tmp_path / "q.gguf", tiny_model("qwen2"), "qwen2", qtype=Q.Q4_K)
    args = ServerArgs(model=str(tmp_path / "q.gguf")).resolve()
    if kernel_isa() == "scalar":
        assert args.quantization == "none"
    else:
        assert args.quantization == "gguf_native" and args.dtype == "float32"
        assert "own quantized blocks" in args.quantization_reason
    folder = ml.resolve_model_path(str(tmp_path / "q.gguf"), str(tmp_path / "cache"))
    assert (
        ServerArgs(model=folder).resolve().quantization == args.quantization
    )  # the scheduler resolves again


def test_unserved_type_is_refused_at_start_naming_tensor_and_type(tmp_path: Path) -> None:
    write_gguf(
        tmp_path / "iq.gguf", tiny_model("qwen3"), "qwen3", qtype=Q.Q4_K, types={"ffn_up.weight": Q.IQ4_XS}
    )
    folder = ml.resolve_model_path(str(tmp_path / "iq.gguf"), str(tmp_path / "cache"))
    with pytest.raises(
        ValueError, match=r"tensor blk\.0\.ffn_up\.weight is stored as IQ4_XS.*not serve in place"
    ):
        runner_for(folder, quantization="gguf_native")


@pytest.mark.slow
def test_native_scheduler_decode_agrees_with_float32(tmp_path: Path) -> None:
    """Through the real scheduler (speculative decoding on, as by default): greedy tokens of the Q4_K_M file
    served natively against transformers' float32 on the same weights, top-1 agreement per step."""
    from runtime.managers.scheduler.scheduler import Scheduler
    from runtime.messages import GenerateReq
    from runtime.sampling_params import SamplingParams
    from runtime.server_args import ServerArgs

    model = tiny_model("qwen2")
    encoded = write_gguf(tmp_path / "q.gguf", model, "qwen2", qtype=Q.Q4_K, types=Q4_K_M)
    folder = ml.resolve_model_path(str(tmp_path / "q.gguf"), str(tmp_path / "cache"))
    args = ServerArgs(
        model=folder, dtype="float32", quantization="gguf_native", kv_cache_dtype="float32",
        max_total_tokens=1024, log_interval=0, attention_backend="torch_native",
    )  # fmt: skip
    sched = Scheduler(args, folder, tokenizer=ml.load_tokenizer(folder))
    params = SamplingParams(max_new_tokens=12, min_new_tokens=12, temperature=0.0)
    for i, ids in enumerate(PROMPTS):
        sched.handle(GenerateReq(rid=str(i), input_ids=ids, params=params))
    outs: dict[str, list[int]] = {}
    while sched.has_work():
        for o in sched.step():
            outs.setdefault(o.rid, []).extend(o.new_token_ids)
    sched.check_accounting()
    ref = with_weights(model, encoded)
    same = total = 0
    for i, ids in enumerate(PROMPTS):
        tokens = list(ids) + outs[str(i)]
        with torch.no_grad():  # the float model's choice at every step of the served sequence
            logits = ref(torch.tensor([tokens])).logits[0, len(ids) - 1 : -1]
        logits[:, 2] = -float("inf")  # min_new_tokens bans EOS
        top2 = logits.topk(2, -1).values
        decided = top2[:, 0] - top2[:, 1] >= TIE * logits[:, 3:].std()
        hit = logits.argmax(-1) == torch.tensor(outs[str(i)])
        assert hit.float().mean() >= 0.9, f"prompt {i}: {hit.tolist()}"
        same += int(hit[decided].sum())
        total += int(decided.sum())
    assert total >= 24 and same / total >= MIN_AGREEMENT, f"{same}/{total} decided steps agree"


def test_float_folder_for_transformers(tmp_path: Path) -> None:
    """The float32 copy written on request for programs that read a folder (transformers, vLLM): the
    dequantized weights, loadable by transformers; a plain folder is returned as it is."""
    from transformers import AutoModelForCausalLM

    from runtime.models.gguf import float_folder

    model = tiny_model("qwen3")
    encoded = write_gguf(tmp_path / "f.gguf", model, "qwen3", qtype=Q.Q8_0)
    folder = ml.resolve_model_path(str(tmp_path / "f.gguf"), str(tmp_path / "cache"))
    copy = float_folder(folder)
    assert copy != folder and float_folder(copy) == copy and float_folder(folder) == copy  # written once
    loaded = AutoModelForCausalLM.from_pretrained(copy, dtype=torch.float32).eval()
    state = loaded.state_dict()
    for name, w in encoded.items():
        torch.testing.assert_close(state[name], w, rtol=0, atol=0)
