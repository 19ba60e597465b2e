"""Guaranteed validity of forced tool calls over real-world function schemas, without a model.

For the first 200 function-calling parameter schemas of jsonschemabench's Glaiveai2K subset, the `required`
grammar (hermes format; the arguments part is the same for every parser) is compiled over a byte
vocabulary (the automaton the served grammar uses, minus the walk over the model's tokens) and walked by a
random "model" that picks any allowed byte, drifting towards an accepting state so that strings end.
Whatever it writes must parse back into exactly one call whose arguments validate with `jsonschema`: the
model only chooses among what the grammar allows, so this is the guarantee itself.
(tests/e2e/test_tool_call_schemas.py runs the same schemas through the real server and model.)
"""

from __future__ import annotations

import json
import random
import re
from collections import deque
from pathlib import Path

import jsonschema
import outlines_core
import pytest

from constrained.spec import regex_accepts
from runtime.entrypoints.tool_calls.base import get_parser
from runtime.entrypoints.tool_calls.output import final_message
from runtime.entrypoints.tool_calls.schema import ToolChoice, ToolRequestError, forced_regex, parse_tools

DATA = Path(__file__).resolve().parents[2] / "bench/data/jsonschemabench/Glaiveai2K.jsonl"
NUM_SCHEMAS = 200
_VOCAB = outlines_core.Vocabulary(256, {bytes([b]): [b] for b in range(256)})


def random_walk(index: outlines_core.Index, rng: random.Random) -> str:
    """Bytes of a random accepted string: random allowed bytes, with a growing pull towards the end."""
    dist, todo = {s: 0 for s in index.get_final_states()}, deque(index.get_final_states())
    back: dict[int, list[int]] = {}
    for src, edges in index.get_transitions().items():
        for dst in edges.values():
            back.setdefault(dst, []).append(src)
    while todo:
        s = todo.popleft()
        for p in back.get(s, []):
            if p not in dist:
                dist[p] = dist[s] + 1
                todo.append(p)
    state, out = index.get_initial_state(), bytearray()
    for step in range(100_000):
        edges = {b: dst for b, dst in index.get_transitions().get(state, {}).items() if b < 256}
        if index.is_final_state(state) and (not edges or rng.random() < min(1.0, step / 200)):
            break
        closer = [b for b, dst in edges.items() if dist.get(dst, 1 << 30) < dist[state]]
        pool = closer if closer and rng.random() < min(0.95, 0.3 + step / 300) else list(edges)
        byte = rng.choice(pool)
        out.append(byte)
        state = edges[byte]
    return out.decode("utf-8", errors="strict")


# No known gap: `properties` next to a root `oneOf` of object branches that redefine properties
# (calculate_area_27950976) is merged into each branch by constrained.one_of.
KNOWN_GAPS: set[str] = set()
# Schemas the grammar cannot satisfy, answered with a 400 naming why: no object satisfies the first
# (`required` lists every property and oneOf wants exactly one branch); the second's required `base` depends
# on a `triangle` property that `properties` does not list, and the grammar emits only listed properties.
UNSATISFIABLE = {
    "calculate_area_2f92f3ea": "cannot be satisfied",
    "calculate_area_08e029cf": "`dependencies` of the required 'base' cannot be enforced",
}


@pytest.mark.model  # ~20 s: compiles grammars over the default tokenizer's vocabulary
def test_forced_calls_validate_for_200_real_schemas():
    parser, rng = get_parser("hermes"), random.Random(0)
    rows = [json.loads(line) for line in DATA.read_text().splitlines()]
    checked = 0
    for row in rows:
        if checked == NUM_SCHEMAS:
            break
        if row["id"] in KNOWN_GAPS:
            continue
        tool_json = {"type": "function", "function": {"name": row["id"][:64], "parameters": row["schema"]}}
        [tool] = parse_tools([tool_json])
        if row["id"] in UNSATISFIABLE:
            with pytest.raises(ToolRequestError, match=re.escape(UNSATISFIABLE[row["id"]])):
                forced_regex(parser, [tool], ToolChoice("required"), parallel=False)
            continue
        index = outlines_core.Index(
            forced_regex(parser, [tool], ToolChoice("required"), parallel=False), _VOCAB
        )
        for _ in range(3):
            text = random_walk(index, rng)
            content, calls = final_message(parser, text, constrained=True)
            assert content is None and len(calls) == 1, (row["id"], text)
            assert calls[0]["function"]["name"] == tool.name
            jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), tool.parameters)
        checked += 1
    assert checked == NUM_SCHEMAS


def test_required_branches_are_enforced():
    schema = {
        "type": "object",
        "properties": {
            "radius": {"type": "number"},
            "length": {"type": "number"},
            "width": {"type": "number"},
        },
        "oneOf": [{"required": ["radius"]}, {"required": ["length", "width"]}],
    }
    [tool] = parse_tools([{"type": "function", "function": {"name": "area", "parameters": schema}}])
    regex = forced_regex(get_parser("llama3"), [tool], ToolChoice("required"), parallel=False)
    call = '{"name": "area", "parameters": %s}'
    assert regex_accepts(regex, call % '{"radius": 1}')
    assert regex_accepts(regex, call % '{"length": 1, "width": 2}')
    assert not regex_accepts(regex, call % "{}")
    assert not regex_accepts(regex, call % '{"radius": 1, "length": 1, "width": 2}')


# ---- the same guarantee on the Lark path (tool_calls/grammar.py; llguidance over a byte vocabulary)
_CLOSERS = frozenset(b'"}]')


def lark_walk(matcher, rng: random.Random) -> str:
    """Bytes of a random accepted string: random allowed bytes, pulled more and more towards the bytes that
    close strings, objects and arrays (llguidance gives no distance to the end, as the DFA walk has)."""
    from tests.unit.test_tool_call_grammar import TOK

    matcher.reset()
    out = bytearray()
    for step in range(20_000):
        bias = matcher.compute_logit_bias()
        allowed = [b for b in range(256) if bias[b]]
        if matcher.is_accepting() and (not allowed or rng.random() < min(1.0, step / 200)):
            break
        closers = [b for b in allowed if b in _CLOSERS]
        pool = closers if closers and rng.random() < min(0.95, 0.3 + step / 300) else allowed
        byte = rng.choice(pool)
        assert matcher.consume_token(byte), matcher.get_error()
        out.append(byte)
    assert matcher.is_accepting(), bytes(out)[-200:]
    assert TOK.vocab_size == 257
    return out.decode("utf-8", errors="strict")


# The Lark path enforces `properties` next to a root `oneOf` as their intersection: no known gap there.
LARK_UNSATISFIABLE = UNSATISFIABLE


def test_lark_forced_calls_validate_for_200_real_schemas():
    from llguidance import LLMatcher

    from runtime.entrypoints.tool_calls.grammar import forced_lark
    from tests.unit.test_tool_call_grammar import TOK

    parser, rng = get_parser("hermes"), random.Random(0)
    rows = [json.loads(line) for line in DATA.read_text().splitlines()]
    checked = 0
    for row in rows:
        if checked == NUM_SCHEMAS:
            break
        tool_json = {"type": "function", "function": {"name": row["id"][:64], "parameters": row["schema"]}}
        [tool] = parse_tools([tool_json])
        if row["id"] in LARK_UNSATISFIABLE:
            with pytest.raises(ToolRequestError, match=re.escape(LARK_UNSATISFIABLE[row["id"]])):
                forced_lark(parser, [tool], ToolChoice("required"), parallel=False)
            continue
        lark = forced_lark(parser, [tool], ToolChoice("required"), parallel=False)
        assert LLMatcher.validate_grammar(lark, TOK) == "", row["id"]
        matcher = LLMatcher(TOK, lark, log_level=0)
        for _ in range(3):
            text = lark_walk(matcher, rng)
            content, calls = final_message(parser, text, constrained=True)
            assert content is None and len(calls) == 1, (row["id"], text)
            assert calls[0]["function"]["name"] == tool.name
            jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), tool.parameters)
        checked += 1
    assert checked == NUM_SCHEMAS
