"""Grammars closed before the token budget ends (issue 47, item 3: a tool call is never cut by max_tokens):
`constrained.closing` on every engine, then the scheduler steering real requests with it."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import jsonschema
import pytest

from constrained import GrammarCompiler
from constrained.closing import ClosingRanks, closing_path
from tests.scheduler_utils import make_scheduler
from tests.unit.test_speculative import gen

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "n": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        "where": {"type": "object", "properties": {"lat": {"type": "number"}}, "required": ["lat"]},
    },
    "required": ["city", "n", "tags", "where"],
}
PREFIXES = [
    "",
    '{"city": "Oslo is a very \\"nice',
    '{"city": "x", "n": 12',
    '{"city": "x", "n": 1, "tags": ["a", "b',
]
TOOL = {
    "type": "function",
    "function": {
        "name": "write_note",
        "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
    },
}


@pytest.fixture(scope="module")
def compilers(default_tokenizer):
    return {}


def compiler(compilers, tokenizer, backend: str) -> GrammarCompiler:
    if backend not in compilers:
        pytest.importorskip(backend if backend != "outlines" else "outlines_core")
        compilers[backend] = GrammarCompiler(tokenizer, len(tokenizer), backend=backend)
    return compilers[backend]


@pytest.mark.parametrize("backend", ["llguidance", "outlines", "xgrammar"])
@pytest.mark.parametrize("prefix", PREFIXES)
def test_closing_path_ends_the_grammar_from_any_state(compilers, default_tokenizer, backend, prefix):
    """From the start, inside an escaped string, after a number, inside an array: the path ends the grammar
    (its text completes valid JSON under the schema) and the cursor is left where it was."""
    c = compiler(compilers, default_tokenizer, backend)
    ranks = ClosingRanks(c.vocab.token_bytes, c.vocab.eos_token_id)
    m = c.compile("json_schema", json.dumps(SCHEMA)).new_matcher()
    ids = default_tokenizer.encode(prefix, add_special_tokens=False)
    m.accept_tokens(ids)
    path = closing_path(m, ranks, 200)
    assert path is not None and m.accepted_ids == ids  # rolled back
    m.accept_tokens(path)
    assert m.is_terminated() or m.can_finish()
    text = default_tokenizer.decode(ids + path, skip_special_tokens=True)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert len(path) <= 40, default_tokenizer.decode(path)  # short: closers, not free text
    assert closing_path(m, ranks, 0) in ([], None)


def tool_grammar(tokenizer) -> str:
    from runtime.entrypoints.tool_calls import plan_chat

    class Accept:
        async def validate(self, kind, spec):
            return None

    body = SimpleNamespace(tools=[TOOL], tool_choice="required", parallel_tool_calls=None)
    plan = asyncio.run(
        plan_chat([{"role": "user", "content": "x"}], [{}], body, tokenizer, "auto", Accept(), "auto")
    )
    return plan.grammar["lark"]


def test_closing_path_of_a_tool_call_is_a_whole_call(compilers, default_tokenizer):
    c = compiler(compilers, default_tokenizer, "llguidance")
    ranks = ClosingRanks(c.vocab.token_bytes, c.vocab.eos_token_id)
    m = c.compile("lark", tool_grammar(default_tokenizer)).new_matcher()
    path = closing_path(m, ranks, 200)
    assert path[-1] == ranks.eos_token_id  # parallel calls: the grammar ends by EOS
    text = default_tokenizer.decode(path[:-1])
    assert text.startswith("<tool_call>\n") and text.endswith("</tool_call>"), text
    call = json.loads(text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
    assert call["name"] == "write_note" and isinstance(call["arguments"]["text"], str)


def drive(sched, msgs) -> dict:
    for m in msgs:
        sched.handle(m)
    out: dict = {}
    while sched.has_work():
        for o in sched.step():
            ids, finish = out.setdefault(o.rid, [[], None])
            if o.replaced_tokens:
                del ids[len(ids) - o.replaced_tokens :]
            ids.extend(o.new_token_ids)
            out[o.rid][1] = o.finished_reason or finish
    return out


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("speculative", ["none", "ngram"])
def test_scheduler_closes_schemas_and_tool_calls_inside_any_budget(
    default_model_dir, default_tokenizer, speculative
):
    """Sampled requests that would write on (a long free string, a long note) at budgets from just above the
    shortest valid output up: every one stops by itself inside its budget with valid JSON, under the schema,
    or a whole tool call; with speculation (drafts cut where steering starts) too."""
    prompt = default_tokenizer.encode(
        default_tokenizer.apply_chat_template(
            [{"role": "user", "content": "Describe the history of Rome in great detail."}],
            add_generation_prompt=True,
            tokenize=False,
        ),
        add_special_tokens=False,
    )
    lark = tool_grammar(default_tokenizer)
    c = GrammarCompiler(default_tokenizer, len(default_tokenizer), backend="llguidance")
    ranks = ClosingRanks(c.vocab.token_bytes, c.vocab.eos_token_id)
    msgs, budgets = [], {}
    for kind, spec in (("json_schema", json.dumps(SCHEMA)), ("lark", lark)):
        shortest = len(closing_path(c.compile(kind, spec).new_matcher(), ranks, 200))
        for i, extra in enumerate([0, 2, 9]):
            rid, budget = f"{kind}-{extra}", shortest + extra
            msgs.append(gen(rid, prompt, max_new_tokens=budget, temperature=0.9, seed=i, **{kind: spec}))
            budgets[rid] = budget
    sched = make_scheduler(
        default_model_dir, default_tokenizer, max_running_requests=6, speculative_algorithm=speculative
    )
    res = drive(sched, msgs)
    for rid, (ids, finish) in res.items():
        text = default_tokenizer.decode(ids, skip_special_tokens=True)
        assert finish["type"] == "stop" and len(ids) <= budgets[rid], (rid, finish, text)
        if rid.startswith("json_schema"):
            jsonschema.validate(json.loads(text), SCHEMA)
        else:
            calls = [c for c in text.split("</tool_call>") if c.strip()]
            for c in calls:
                call = json.loads(c.strip().removeprefix("<tool_call>").strip())
                jsonschema.validate(call["arguments"], TOOL["function"]["parameters"])


# thoughts with quotes and braces, half a close tag, half a character (the tag waits for its end)
THOUGHTS = ["", '\nLet me think about "Oslo {and [its', "\nalmost done </thi", "\nin 所"]


@pytest.mark.parametrize("parser", ["deepseek-r1", "qwen3"])
@pytest.mark.parametrize("thoughts", THOUGHTS)
def test_closing_path_closes_the_thoughts_then_the_answer(compilers, default_tokenizer, parser, thoughts):
    """A reasoning grammar (thoughts, then the answer's schema): from inside thoughts that hold quotes,
    braces or half a close tag, the path writes the rest of `</think>` and then a whole answer; the JSON
    measure ignores the thoughts. A grammar that may open thoughts is never made to: from its start the path
    is the answer alone, about as short as without thoughts."""
    from constrained.closing import IN_THOUGHTS, MAY_OPEN_THOUGHTS, thoughts_of
    from runtime.entrypoints.wire.reasoning import ReasoningParser, grammar_after_thoughts

    reasoning = ReasoningParser(parser, starts_inside=parser == "deepseek-r1")
    spec = asyncio.run(grammar_after_thoughts(reasoning, {"json_schema": json.dumps(SCHEMA)}))["regex"]
    c = compiler(compilers, default_tokenizer, "llguidance")
    ranks = ClosingRanks(c.vocab.token_bytes, c.vocab.eos_token_id)
    fresh = c.compile("regex", spec).new_matcher()
    where = thoughts_of(fresh, ranks)
    assert where == (IN_THOUGHTS if reasoning.starts_inside else MAY_OPEN_THOUGHTS) and not fresh.accepted_ids
    plain = closing_path(c.compile("json_schema", json.dumps(SCHEMA)).new_matcher(), ranks, 200)
    if not reasoning.starts_inside:
        start = closing_path(fresh, ranks, 200, where)
        text = default_tokenizer.decode(start, skip_special_tokens=True)
        assert not text.startswith("<") and len(start) <= len(plain) + 2, text
        jsonschema.validate(json.loads(text), SCHEMA)
    written = thoughts if reasoning.starts_inside else "<think>" + thoughts
    ids = default_tokenizer.encode(written, add_special_tokens=False)
    if thoughts.endswith("所"):  # its last byte left out: the text ends inside the character
        ids = ids[:-1]
    fresh.accept_tokens(ids)
    path = closing_path(fresh, ranks, 200, where)
    assert path is not None and fresh.accepted_ids == ids
    text = default_tokenizer.decode(ids + path, skip_special_tokens=True)
    split = reasoning.split(text)
    assert split.reasoning is not None and split.reasoning.startswith(written.removeprefix("<think>")[:4])
    jsonschema.validate(json.loads(split.answer), SCHEMA)
    assert len(path) <= len(plain) + 5, default_tokenizer.decode(path)  # a character's end, the tag, answer
