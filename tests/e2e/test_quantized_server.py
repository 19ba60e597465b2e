"""`--quantization w4a8` through the real server: the scheduler process builds (or finds cached) the C++
kernel, serves greedy tokens equal to an in-process w4a8 runner's, reuses a cached prefix without changing
them (activation scales are per row and block, so a token's result does not depend on its batch), and
leaks no KV slot."""

from __future__ import annotations

import requests

from runtime.model_executor.model_runner import ModelRunner
from tests.e2e.server_utils import HTTP_TIMEOUT_S, ServerProcess, assert_no_kv_leak, wait_idle
from tests.unit.test_compiled_decode import greedy_decode

STEPS = 6
PROMPT = [1, 504, 3458, 282, 4649, 314, 28, 9690, 28, 905, 1351, 314]  # token ids of the default vocabulary


def test_w4a8_server_matches_the_runner_and_reuses_its_cache(default_model_dir):
    greedy = {"max_new_tokens": STEPS, "temperature": 0, "ignore_eos": True}
    args = ["--quantization", "w4a8", "--max-total-tokens", "4096"]
    with ServerProcess(extra_args=args, log_level="info") as srv:
        outs = []
        for _ in range(2):
            r = requests.post(
                srv.url + "/generate",
                json={"input_ids": PROMPT, "sampling_params": greedy},
                timeout=HTTP_TIMEOUT_S,
            )
            assert r.status_code == 200, r.text
            outs.append(r.json())
        assert_no_kv_leak(wait_idle(srv.url))
        info = requests.get(srv.url + "/get_server_info", timeout=HTTP_TIMEOUT_S).json()
        log = srv.log()
    assert outs[1]["meta_info"]["cached_tokens"] > 0
    assert outs[0]["output_ids"] == outs[1]["output_ids"]
    runner = ModelRunner(default_model_dir, max_total_tokens=256, max_running_requests=1, quantization="w4a8")
    want, _ = greedy_decode(runner, [PROMPT], STEPS - 1)  # the extend's token, then STEPS - 1 decode steps
    assert outs[0]["output_ids"] == [row[0] for row in want]
    assert info["quantization"] == "w4a8"
    # the scheduler really swapped every layer (30 x 4 Q4_1) and the head (Q8_0): w4a8's tokens can equal
    # float32's, so the equality above alone would not show it
    assert "'q4_1': 120, 'q8_0': 1" in log, log[-3000:]


def test_default_flags_pick_the_measured_mode_and_say_why():
    """`--dtype auto --quantization auto` (the defaults ServerProcess overrides): the server runs what
    `ServerArgs.resolve()` picks on this machine (w4a8 on AVX512-VNNI CPUs, else bf16 or float32), logs it
    with its figures at start-up and reports both in /server_info."""
    from runtime.server_args import ServerArgs

    want = ServerArgs(device="cpu").resolve()
    assert want.quantization_reason
    args = ["--dtype", "auto", "--quantization", "auto", "--max-total-tokens", "4096"]
    with ServerProcess(extra_args=args, log_level="info") as srv:
        r = requests.post(
            srv.url + "/generate",
            json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "temperature": 0}},
            timeout=HTTP_TIMEOUT_S,
        )
        assert r.status_code == 200, r.text
        info = requests.get(srv.url + "/server_info", timeout=HTTP_TIMEOUT_S).json()
        log = srv.log()
    assert (info["dtype"], info["quantization"]) == (want.dtype, want.quantization)
    assert info["quantization_reason"] == want.quantization_reason
    line = f"--quantization {want.quantization} --dtype {want.dtype}: {want.quantization_reason}"
    assert line in log, log[-3000:]
