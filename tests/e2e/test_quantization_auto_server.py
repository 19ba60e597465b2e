"""`radixlm serve --quantization auto` with a Hugging Face folder nobody measured: the server measures it
before starting the scheduler, logs the figures and the choice, serves the chosen mode and leaves the
answer beside the weights (the cache's reuse: tests/unit/test_quant_probe.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import requests

from runtime import platform
from runtime.model_executor.quant_probe import CACHE_FILE
from runtime.models.quantization import probe_candidates
from tests.e2e.server_utils import HTTP_TIMEOUT_S, ServerProcess
from tests.unit.test_quant_probe import save_tiny_llama


def test_a_folder_is_measured_at_start_and_served_in_the_chosen_mode(tmp_path, default_tokenizer):
    modes, skipped = probe_candidates(platform.cpu_flags(), platform.find_cxx_compiler() is not None)
    if "w4a8" not in modes:
        pytest.skip(f"w4a8 does not run fast here: {skipped}")
    model = save_tiny_llama(tmp_path / "sharp", default_tokenizer, hidden=64, layer_std=0.02)
    args = ["--quantization", "auto", "--max-total-tokens", "4096"]  # after ServerProcess's `none`: it wins
    with ServerProcess(model=model, extra_args=args, log_level="info") as srv:
        r = requests.post(
            srv.url + "/generate",
            json={
                "input_ids": [1, 504, 3458, 282],
                "sampling_params": {"max_new_tokens": 2, "temperature": 0},
            },
            timeout=HTTP_TIMEOUT_S,
        )
        assert r.status_code == 200, r.text
        info = requests.get(srv.url + "/get_server_info", timeout=HTTP_TIMEOUT_S).json()
        log = srv.log()
    want = "--quantization w4a8 --dtype float32: quantization auto: w4a8 agrees 1.000 with float32 on 2,048 "
    assert want in log, log[-3000:]
    assert "; chose w4a8 (measured in " in log and f"cached in {Path(model) / CACHE_FILE})" in log
    assert info["quantization"] == "w4a8" and info["quantization_reason"].startswith(
        "quantization auto: w4a8"
    )
    assert "quantization=w4a8" in log  # the scheduler's runner loaded it
    assert json.loads((Path(model) / CACHE_FILE).read_text())["chosen"] == "w4a8"
