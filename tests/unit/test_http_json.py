"""The HTTP layer's JSON encoding (orjson): what clients rely on stays as it was with json.dumps."""

from __future__ import annotations

import json
import math

import pytest

from runtime.entrypoints.http_common import FastJSONResponse, dumps, error_response, sse

DOC = {
    "text": 'café 日本 🙂 "q" \\ \n\t\u2028',
    "output_ids": [1, 2, 49151],
    "meta_info": {
        "finish_reason": {"type": "stop", "matched": None},
        "output_token_logprobs": [[-0.25, 7, "é"]],
    },
}


def test_round_trips_and_keeps_non_ascii_raw():
    body = dumps(DOC)
    assert json.loads(body) == DOC
    assert "café 日本 🙂".encode() in body  # UTF-8 as is, not \u-escaped (as with ensure_ascii=False)
    assert b'"output_ids":[1,2,49151]' in body  # compact separators


def test_values_json_cannot_spell_become_null_and_keys_strings():
    assert json.loads(dumps({"lp": -math.inf, "x": math.nan, 3: "k"})) == {"lp": None, "x": None, "3": "k"}


def test_sse_event_framing():
    event = sse(DOC)
    assert event.startswith(b"data: ") and event.endswith(b"\n\n") and event.count(b"\n\n") == 1
    assert json.loads(event[len(b"data: ") : -2]) == DOC  # a newline in text is escaped, never raw


def test_response_class_and_error_object():
    resp = FastJSONResponse(DOC, status_code=201)
    assert resp.status_code == 201 and resp.media_type == "application/json" and json.loads(resp.body) == DOC
    err = error_response(400, "bad \udcff input")  # a lone surrogate quoted from the client's input
    assert json.loads(err.body)["error"] == {
        "message": "bad \\udcff input",
        "type": "invalid_request_error",
        "param": None,
        "code": 400,
    }


def test_unencodable_value_is_an_error_not_garbage():
    with pytest.raises(TypeError):
        dumps({"x": object()})
