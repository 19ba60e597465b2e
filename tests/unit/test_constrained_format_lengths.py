"""Formats with an RFC length limit are bounded on the llguidance paths (issue 23): llguidance's ``email`` and
``hostname`` regexes bound no length, and under ``tool_choice: "required"`` the 135M model wrote an attendee
email past 1,024 tokens. ``constrained.formats.cap_format_length`` adds the limit as ``maxLength``
(intersected with the schema's own bounds) on both the ``json_schema`` path (``backends.llguidance._prepare``)
and the tool-call Lark path (``tool_calls.grammar.closed_objects``). Random walks (tiny ASCII vocabulary, no
model) validate with ``jsonschema`` and its FormatChecker; hand-written texts at the limit and one past it.
"""

from __future__ import annotations

import json
import re

import jsonschema
import llguidance
import pytest

from constrained.backends import get_backend, is_available
from constrained.formats import FORMAT_MAX_LENGTHS, cap_format_length
from runtime.entrypoints.tool_calls.base import Call, get_parser
from runtime.entrypoints.tool_calls.grammar import forced_lark
from runtime.entrypoints.tool_calls.schema import ToolChoice, parse_tools
from tests.grammar_walks import accepts, ascii_vocab, assert_walks_valid, compiled, walk

pytestmark = pytest.mark.skipif(not is_available("llguidance"), reason="llguidance is not installed")

# RFC-valid texts exactly at the limit: local part 64 (RFC 5321 4.5.3.1.1), labels of at most 63 characters
LOCAL = "a" * 64
EMAIL_254 = f"{LOCAL}@{'b' * 63}.{'c' * 63}.{'d' * 57}.com"
EMAIL_255 = f"{LOCAL}@{'b' * 63}.{'c' * 63}.{'d' * 58}.com"
HOST_253 = ".".join(["h" * 63] * 3 + ["i" * 61])
HOST_254 = ".".join(["h" * 63] * 3 + ["i" * 62])
_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def _checked(schema):
    return jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())


def _rfc_hostname(text: str) -> bool:
    """RFC 1123 hostname syntax and RFC 1035's 253-character limit (jsonschema checks `hostname` only with
    the optional `fqdn` package)."""
    return len(text) <= 253 and all(_LABEL.fullmatch(label) for label in text.split("."))


@pytest.fixture(scope="module")
def vocab():
    return ascii_vocab()


def test_texts_are_what_they_claim():
    assert len(EMAIL_254) == 254 and len(EMAIL_255) == 255
    assert len(HOST_253) == 253 and len(HOST_254) == 254
    assert _rfc_hostname(HOST_253) and not _rfc_hostname(HOST_254)
    assert FORMAT_MAX_LENGTHS["email"] == 254 and FORMAT_MAX_LENGTHS["hostname"] == 253


def test_cap_intersects_with_the_schemas_own_bounds():
    email = {"type": "string", "format": "email"}
    assert cap_format_length(email) == {**email, "maxLength": 254}
    assert cap_format_length({**email, "maxLength": 40})["maxLength"] == 40  # smaller: kept
    assert cap_format_length({**email, "maxLength": 4000})["maxLength"] == 254  # larger: lowered
    assert cap_format_length({**email, "minLength": 10}) == {**email, "minLength": 10, "maxLength": 254}
    assert cap_format_length({"format": "hostname"}) == {"format": "hostname", "maxLength": 253}
    for unchanged in (
        {"type": "string", "format": "uri"},  # RFC 3986 gives no limit: none invented
        {"type": "string", "format": "date-time"},
        {**email, "enum": ["a@b.c"]},
        {**email, "const": "a@b.c"},
        {**email, "minLength": 300},  # above the limit: left as written, not made unsatisfiable
        {**email, "maxLength": "10"},  # not an integer: the backend names the error
        {"type": "string"},
    ):
        assert cap_format_length(unchanged) is unchanged


def test_json_schema_path_email_at_the_limit(vocab):
    schema = {"type": "string", "format": "email"}
    grammar = compiled("llguidance", schema, vocab)
    assert accepts(grammar, vocab, json.dumps(EMAIL_254))
    assert not accepts(grammar, vocab, json.dumps(EMAIL_255))
    # the limit is ours: llguidance's own format admits the longer text
    raw = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides={"lenient": False})
    tok = get_backend("llguidance").tokenizer(vocab)
    m = llguidance.LLMatcher(tok, raw, log_level=0)
    assert m.consume_tokens(vocab.encode_bytes_greedy(json.dumps(EMAIL_255).encode())) and m.is_accepting()


def test_json_schema_path_hostname_at_the_limit(vocab):
    grammar = compiled("llguidance", {"type": "string", "format": "hostname"}, vocab)
    assert accepts(grammar, vocab, json.dumps(HOST_253))
    assert not accepts(grammar, vocab, json.dumps(HOST_254))


def test_json_schema_path_keeps_the_schemas_bounds(vocab):
    schema = {"type": "string", "format": "email", "minLength": 8, "maxLength": 12}
    grammar = compiled("llguidance", schema, vocab)
    assert accepts(grammar, vocab, '"abcd@ef.com"') and accepts(grammar, vocab, '"ab@cd.ef"')
    assert not accepts(grammar, vocab, '"abcdef@ef.com"')  # 13 > maxLength
    assert not accepts(grammar, vocab, '"a@b.cd"')  # 6 < minLength


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "format": "email"},
        {"type": "string", "format": "hostname"},
        {"type": "string", "format": "email", "minLength": 20, "maxLength": 30},
        {
            "type": "object",
            "properties": {
                "to": {"type": "array", "items": {"type": "string", "format": "email"}, "maxItems": 2},
                "host": {"type": "string", "format": "hostname", "maxLength": 64},
            },
            "required": ["to", "host"],
        },
    ],
    ids=["email", "hostname", "email-bounded", "nested"],
)
def test_json_schema_path_walks_validate(schema, vocab):
    grammar = compiled("llguidance", schema, vocab)
    assert_walks_valid(grammar, vocab, _checked(schema), min_finished=6, seeds=10)
    for seed in range(10):
        text = walk(grammar, vocab, seed)
        if text is None:
            continue
        for value in _strings(json.loads(text)):
            assert len(value) <= 254
            if "@" not in value:
                assert _rfc_hostname(value), value


def _strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


INVITE = {
    "type": "function",
    "function": {
        "name": "invite",
        "parameters": {
            "type": "object",
            "properties": {
                "attendees": {"type": "array", "items": {"type": "string", "format": "email"}},
                "server": {"type": "string", "format": "hostname"},
            },
            "required": ["attendees", "server"],
        },
    },
}


def test_tool_call_path_is_capped_too(vocab):
    """The tools' Lark grammar (`%json` per tool, not `_prepare`) bounds the formats the same way."""
    parser = get_parser("llama3")  # one line of JSON: the ASCII vocabulary can write it
    tools = parse_tools([INVITE])
    lark = forced_lark(parser, tools, ToolChoice("required"), parallel=False)
    backend = get_backend("llguidance")
    text, payload = backend.build("lark", lark, "", vocab)
    grammar = backend.load("lark", lark, text, payload, vocab, vocab.num_ids, 0.0, 0)

    def call(attendees, server):
        return parser.format_calls([Call("invite", json.dumps({"attendees": attendees, "server": server}))])

    assert accepts(grammar, vocab, call([EMAIL_254, "x@y.z"], HOST_253))
    assert not accepts(grammar, vocab, call([EMAIL_255], HOST_253))
    assert not accepts(grammar, vocab, call([EMAIL_254], HOST_254))
    validator = _checked(INVITE["function"]["parameters"])
    finished = 0
    for seed in range(16):
        out = walk(grammar, vocab, seed)
        if out is None:
            continue
        args = json.loads(out)["parameters"]
        validator.validate(args)
        assert all(len(a) <= 254 for a in args["attendees"]) and _rfc_hostname(args["server"])
        finished += 1
    assert finished >= 6
