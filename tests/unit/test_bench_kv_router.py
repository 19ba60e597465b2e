"""bench.kv_router's pure parts: the replicas' counter changes into hit rates and load shares."""

import pytest

from bench.kv_router import replica_figures


def _c(prompt: float, cached: float, generated: float = 0.0) -> dict[str, float]:
    return {"prompt_tokens": prompt, "cached_tokens": cached, "generated_tokens": generated}


def test_replica_figures_sums_changes_over_replicas():
    before = [_c(100, 50, 10), _c(0, 0, 0)]
    after = [_c(1100, 850, 60), _c(3000, 1200, 90)]
    f = replica_figures(before, after)
    assert f["prompt_tokens"] == 4000 and f["cached_tokens"] == 2000
    assert f["cache_hit_rate"] == pytest.approx(0.5)
    r0, r1 = f["replicas"]
    assert r0["prompt_tokens"] == 1000 and r0["cached_tokens"] == 800 and r0["generated_tokens"] == 50
    assert r0["cache_hit_rate"] == pytest.approx(0.8) and r1["cache_hit_rate"] == pytest.approx(0.4)
    assert r0["prompt_share"] == pytest.approx(0.25) and r1["prompt_share"] == pytest.approx(0.75)


def test_replica_figures_idle_replica_has_no_hit_rate():
    f = replica_figures([_c(0, 0), _c(5, 5)], [_c(200, 150), _c(5, 5)])
    assert f["cache_hit_rate"] == pytest.approx(0.75)
    assert f["replicas"][1]["cache_hit_rate"] is None and f["replicas"][1]["prompt_share"] == 0.0


def test_replica_figures_no_work_gives_none():
    f = replica_figures([_c(7, 3)], [_c(7, 3)])
    assert f["cache_hit_rate"] is None and f["replicas"][0]["prompt_share"] is None


def test_replica_figures_rejects_restarted_replica_and_mismatched_lists():
    with pytest.raises(ValueError, match="replica 1: a counter went down"):
        replica_figures([_c(0, 0), _c(500, 100)], [_c(10, 0), _c(20, 0)])
    with pytest.raises(ValueError, match="2 before, 1 after"):
        replica_figures([_c(0, 0), _c(0, 0)], [_c(0, 0)])


# ---------------------------------------------------------------------------------------- the Dynamo adapter
def test_generate_body_maps_preprocessed_request():
    from bench.router_dynamo_worker import generate_body

    req = {
        "token_ids": [1, 2, 3],
        "stop_conditions": {"max_tokens": 48, "stop": ["</s>"]},
        "sampling_options": {"temperature": 0.0, "top_k": None, "guided_decoding": {"regex": "a+"}},
    }
    body = generate_body(req)
    assert body == {
        "input_ids": [1, 2, 3],
        "sampling_params": {"max_new_tokens": 48, "temperature": 0.0, "stop": ["</s>"], "regex": "a+"},
    }
    schema = generate_body(
        {"token_ids": [5], "sampling_options": {"guided_decoding": {"json": {"type": "object"}}}}
    )
    assert schema["sampling_params"]["json_schema"] == '{"type": "object"}'
    assert (
        schema["sampling_params"]["max_new_tokens"] == 256 and schema["sampling_params"]["temperature"] == 1.0
    )


def test_generate_body_rejects_bad_requests():
    from bench.router_dynamo_worker import generate_body

    with pytest.raises(ValueError, match="token_ids"):
        generate_body({"token_ids": []})
    with pytest.raises(ValueError, match="guided decoding"):
        generate_body({"token_ids": [1], "sampling_options": {"guided_decoding": {"grammar": "root ::= x"}}})


def test_engine_output_carries_ids_finish_and_cached_tokens():
    from bench.router_dynamo_worker import engine_output

    answer = {
        "text": "xy",
        "output_ids": [7, 8],
        "meta_info": {"finish_reason": {"type": "length"}, "prompt_tokens": 40, "cached_tokens": 32},
    }
    out = engine_output(answer, 40)
    assert out["token_ids"] == [7, 8] and out["finish_reason"] == "length"
    assert out["completion_usage"] == {
        "prompt_tokens": 40,
        "completion_tokens": 2,
        "total_tokens": 42,
        "prompt_tokens_details": {"cached_tokens": 32},
    }
    assert (
        engine_output({"output_ids": [], "meta_info": {"finish_reason": {"type": "stop"}}}, 9)[
            "finish_reason"
        ]
        == "stop"
    )


def test_replica_rank_follows_the_routers_dp_rank():
    from bench.router_dynamo_worker import replica_rank

    assert replica_rank({"routing": {"dp_rank": 1}}, 2) == 1
    assert replica_rank({"routing": None}, 2) == 0 and replica_rank({}, 2) == 0
    with pytest.raises(ValueError, match="dp_rank 2 is not a rank of the 2 replicas"):
        replica_rank({"routing": {"dp_rank": 2}}, 2)


def test_parse_replica():
    from bench.router_dynamo_worker import parse_replica

    assert parse_replica("http://127.0.0.1:30001/=tcp://127.0.0.1:5557") == (
        "http://127.0.0.1:30001",
        "tcp://127.0.0.1:5557",
    )
    for bad in ("http://127.0.0.1:30001", "127.0.0.1:30001=tcp://h:1", "http://h:1=5557"):
        with pytest.raises(ValueError, match="expected HTTP_URL=ZMQ_ENDPOINT"):
            parse_replica(bad)
