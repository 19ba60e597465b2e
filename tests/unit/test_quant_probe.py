"""`--quantization auto` for a Hugging Face folder nobody measured (runtime/model_executor/quant_probe.py):
tiny random Llamas built here are measured with the real loader and runner, the answer is cached beside the
weights (or in $RADIXLM_CACHE_DIR when the folder is read-only) and reused, new weights or another CPU are
measured again, and a mode below the bound, or one that cannot load, gives way to the next or to none.

The models: "sharp" ties its head to a N(0, 1) embedding and draws every other matrix from N(0, 0.02), so
each position's argmax (the input token itself, in effect) is far from a tie: every mode agrees 1.000.
"flat" draws its layers from N(0, 0.3): quantization noise moves many argmaxes (w4a8 0.25, w8a8 0.85 on the
2-core EPYC). "odd" is sharp with hidden size 80, which w4a8's blocks of 32 cannot take.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from runtime import platform
from runtime.model_executor import quant_probe as qp
from runtime.model_executor.quant_probe import CACHE_FILE, auto_quantization
from runtime.models.quantization import probe_candidates
from runtime.server_args import ServerArgs


def save_tiny_llama(path: Path, tokenizer, *, hidden: int, layer_std: float, seed: int = 0) -> str:
    """A 2-layer Llama over `tokenizer`'s whole vocabulary with a tied N(0, 1) embedding, every other matrix
    from N(0, `layer_std`), saved with the tokenizer; returns the folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),  # the probe's every id is in range
        hidden_size=hidden,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=1,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 1.0 if "embed" in name else layer_std)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(autouse=True)
def _small_probe(tmp_path, monkeypatch):
    """The answers' user cache in a tmp dir (the built kernels stay where they are); 512 probe tokens (2
    windows), so each measurement takes seconds."""
    monkeypatch.setattr(qp, "user_cache_dir", lambda: tmp_path / "cache" / "quantization")
    monkeypatch.setattr(qp, "MAX_TOKENS", 512)


@pytest.fixture(scope="module")
def folders(tmp_path_factory, default_tokenizer) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("probe_models")
    return {
        "sharp": Path(save_tiny_llama(root / "sharp", default_tokenizer, hidden=64, layer_std=0.02)),
        "flat": Path(save_tiny_llama(root / "flat", default_tokenizer, hidden=64, layer_std=0.3)),
        "odd": Path(save_tiny_llama(root / "odd", default_tokenizer, hidden=80, layer_std=0.02)),
    }


@pytest.fixture
def folder(folders, tmp_path):
    """A private copy of one of `folders` (each test writes its own cache file)."""

    def copy(name: str) -> str:
        import shutil

        return str(shutil.copytree(folders[name], tmp_path / name))

    return copy


@pytest.fixture
def measurements(monkeypatch) -> list[str]:
    """The folders `measure` ran on, in order (the real function runs)."""
    calls: list[str] = []
    real = qp.measure

    def counted(model_dir, candidates, *a, **kw):
        calls.append(model_dir)
        return real(model_dir, candidates, *a, **kw)

    monkeypatch.setattr(qp, "measure", counted)
    return calls


def _needs(mode: str) -> None:
    modes, skipped = probe_candidates(platform.cpu_flags(), platform.find_cxx_compiler() is not None)
    if mode not in modes:
        pytest.skip(f"{mode} does not run fast on this machine: {skipped}")


def _resolve(model: str, **kw) -> ServerArgs:
    return ServerArgs(model=model, device="cpu", **kw).resolve(probe=auto_quantization)


# ----------------------------------------------------------------------------------------------- the choice
def test_a_folder_is_measured_once_and_the_answer_is_cached_beside_it(folder, measurements):
    _needs("w4a8")
    model = folder("sharp")
    args = _resolve(model)
    assert (args.dtype, args.quantization) == ("float32", "w4a8"), args.quantization_reason
    why = args.quantization_reason
    assert why.startswith("quantization auto: w4a8 agrees 1.000 with float32 on 512 probe tokens"), why
    assert "; chose w4a8 (measured in " in why and f"cached in {Path(model) / CACHE_FILE})" in why, why
    entry = json.loads((Path(model) / CACHE_FILE).read_text())
    assert entry["chosen"] == "w4a8" and entry["agreement"] == {"w4a8": 1.0}  # w8a8: not measured
    assert entry["tokens"] == 512 and entry["key"]["candidates"][0] == "w4a8"
    from runtime.models.model_loader import weights_fingerprint

    assert entry["key"]["weights"] == weights_fingerprint(model)
    assert measurements == [model]

    again = _resolve(model)  # a second start: the cache, no measurement
    assert (again.dtype, again.quantization) == ("float32", "w4a8")
    assert "w4a8 agrees 1.000" in again.quantization_reason
    where = f"cached in {Path(model) / CACHE_FILE}, measured {entry['measured_at']}"
    assert where in again.quantization_reason
    assert measurements == [model]
    # tensor parallel resolves the same way (once, in the launching process): the ranks get the choice
    assert _resolve(model, tp_size=2).quantization == "w4a8" and measurements == [model]


def test_new_weights_or_another_cpu_are_measured_again(folder, measurements, monkeypatch):
    _needs("w4a8")
    import torch
    from safetensors.torch import load_file, save_file

    model = folder("sharp")
    assert _resolve(model).quantization == "w4a8"
    weights = Path(model) / "model.safetensors"
    tensors = load_file(weights)
    name = next(n for n in tensors if "q_proj" in n)
    tensors[name] = tensors[name] + 0.01 * torch.randn_like(tensors[name])  # same shapes, other values
    save_file(tensors, weights, metadata={"format": "pt"})
    assert "measured in" in _resolve(model).quantization_reason
    assert len(measurements) == 2
    flags = platform.cpu_flags()
    monkeypatch.setattr(platform, "cpu_flags", lambda: flags ^ {"avx512_bf16"})  # in the key, not a candidate
    assert "measured in" in _resolve(model).quantization_reason
    assert len(measurements) == 3
    assert "cached in" in _resolve(model).quantization_reason  # the file holds the last key measured
    assert len(measurements) == 3


def test_below_the_bound_every_mode_is_measured_and_none_chosen(folder, measurements):
    model = folder("flat")
    modes, _ = probe_candidates(platform.cpu_flags(), platform.find_cxx_compiler() is not None)
    if not modes:
        pytest.skip("no quantized mode runs fast here")
    args = _resolve(model)
    entry = json.loads((Path(model) / CACHE_FILE).read_text())
    assert list(entry["agreement"]) == modes  # the fastest failed the bound: the next was measured too
    assert all(a < 0.99 for a in entry["agreement"].values()), entry
    # each stopped after its first window of 256: past 5 mismatches in 512 tokens 0.99 is out of reach
    assert entry["stopped_after"] == dict.fromkeys(modes, 256), entry
    assert (
        f"{modes[0]} {entry['agreement'][modes[0]]:.3f} (stopped after 256 tokens)"
        in args.quantization_reason
    )
    assert args.quantization == "none" and entry["chosen"] == "none"
    assert args.dtype == ("bfloat16" if platform.cpu_has_native_bf16() else "float32")  # auto's rule
    assert "below 0.99; chose none (measured in" in args.quantization_reason, args.quantization_reason


def test_a_mode_that_cannot_load_gives_way_to_the_next(folder):
    _needs("w4a8")
    _needs("w8a8")
    args = _resolve(folder("odd"))
    why = args.quantization_reason
    assert args.quantization == "w8a8", why
    assert "w8a8 agrees 1.000 with float32" in why and "w4a8 failed: w4a8 needs in_features divisible" in why


def test_explicit_quantization_or_dtype_measures_nothing(folder):
    model = folder("sharp")

    def never(*_):
        raise AssertionError("measured")

    given = ServerArgs(model=model, device="cpu", quantization="w8a8").resolve(probe=never)
    assert (given.quantization, given.quantization_reason) == ("w8a8", "--quantization w8a8 given")
    bf16 = ServerArgs(model=model, device="cpu", dtype="bfloat16").resolve(probe=never)
    assert bf16.quantization == "none" and "--dtype bfloat16 given" in bf16.quantization_reason
    plain = ServerArgs(model=model, device="cpu").resolve()  # no probe (a unit test's resolve): none
    assert plain.quantization == "none" and plain.quantization_reason.startswith("not measured")
    two_nodes = ServerArgs(model=model, device="cpu", nnodes=2, tp_size=2, dist_init_addr="tcp://127.0.0.1:1")
    assert two_nodes.resolve(probe=never).quantization == "none"  # each node would measure on its own
    assert not (Path(model) / CACHE_FILE).exists()


# ----------------------------------------------------------------------------------------------- the cache
def test_a_read_only_folder_is_never_written(folder, measurements, tmp_path):
    _needs("w4a8")
    model = Path(folder("sharp"))
    os.chmod(model, 0o555)  # root ignores it for writes: `writable` reads the mode bits too
    try:
        assert not qp.writable(model)
        args = _resolve(str(model))
        assert args.quantization == "w4a8"
        assert not (model / CACHE_FILE).exists()
        cached = list((tmp_path / "cache" / "quantization").glob("*.json"))
        assert len(cached) == 1 and f"cached in {cached[0]}" in args.quantization_reason
        assert stat.S_IMODE(cached[0].stat().st_mode) == 0o600
        assert f"cached in {cached[0]}, measured" in _resolve(str(model)).quantization_reason
        assert len(measurements) == 1
    finally:
        os.chmod(model, 0o755)


def test_a_folder_whose_tokenizer_exceeds_its_vocabulary_is_not_measured(tiny_model_dir, tmp_path):
    """conftest's tiny Llama keeps 512 of SmolLM2's 49,152 ids: the probe text cannot run through it."""
    args = ServerArgs(model=tiny_model_dir, device="cpu", dtype="float32").resolve(probe=auto_quantization)
    assert args.quantization == "none"
    assert "cannot be measured (its tokenizer gives ids up to" in args.quantization_reason
    assert not (Path(tiny_model_dir) / CACHE_FILE).exists()


def test_an_architecture_served_only_in_float_is_not_measured(tmp_path, measurements):
    """gpt-oss has no quantized mode: auto must not load it in float32 to measure modes it refuses."""
    from tests.random_gpt_oss import save_random_gpt_oss

    folder = tmp_path / "gpt_oss"
    save_random_gpt_oss(folder)
    args = ServerArgs(model=str(folder), device="cpu", dtype="float32").resolve(probe=auto_quantization)
    assert args.quantization == "none"
    assert "GptOssForCausalLM is served from its float weights only" in args.quantization_reason
    assert measurements == [] and not (folder / CACHE_FILE).exists()


def test_the_probe_text_ships_with_the_package():
    import tomllib

    text = qp.PROBE_TEXT.read_text()
    assert len(text) > 10_000 and "<tool_call>" in text and "```python" in text and '"port": 8080' in text
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    data = pyproject["tool"]["setuptools"]["package-data"]["runtime.model_executor"]
    assert "data/*.txt" in data


def test_the_data_parallel_front_measures_once_for_its_replicas(folder, measurements, monkeypatch):
    """`--dp-size 2`: the front measures before it starts the replicas (stubbed here: no router, no
    processes), so each replica's own resolve finds the answer cached."""
    _needs("w4a8")
    from runtime.entrypoints import data_parallel as dp

    model = folder("sharp")
    monkeypatch.setattr(dp, "check_router_installed", lambda: None)
    monkeypatch.setattr(dp.DataParallelServer, "run", lambda self: 0)
    assert dp.run_data_parallel(ServerArgs(model=model, device="cpu", dp_size=2)) == 0
    assert measurements == [model] and (Path(model) / CACHE_FILE).is_file()
    for _ in range(2):  # what each replica's run_server does
        assert "cached in" in _resolve(model).quantization_reason
    assert measurements == [model]
