"""Jump-forward under a LoRA adapter, through the real scheduler, on a tiny random Llama over the default
tokenizer's whole vocabulary (so grammars see real token texts).

Jump-forward appends the grammar's forced text as the tokenizer splits it, which may differ from the split
the model would sample, so its tokens are compared with a reference that runs the same algorithm: the same
scheduler, jump-forward on, serving the base model with the adapter merged into its weights (peft's
`merge_and_unload`). If the extend pass that feeds the forced tokens skipped the adapter, every token the
model chooses afterwards would come from different KV. The adapter's request shares its batches with the
base model's and another adapter's, and each is compared with its own reference."""

from __future__ import annotations

import json

import jsonschema
import pytest

from runtime.messages import GenerateReq, RequestOptions
from runtime.sampling_params import SamplingParams
from tests.lora_fixtures import ALL_TARGETS, peft_model, save_random_adapter
from tests.random_llama import save_full_vocab_llama
from tests.scheduler_utils import make_scheduler

pytestmark = [pytest.mark.model, pytest.mark.timeout(900)]

SCHEMA = {
    "type": "object",
    "properties": {
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "city": {"enum": ["Paris", "Tokyo", "Lima", "Oslo"]},
        "rating": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["year", "city", "rating"],
    "additionalProperties": False,
}
PROMPTS = {"a": "Where and when? Reply as JSON.", "b": "Rate a city in JSON.", None: "JSON, please."}


@pytest.fixture(scope="module")
def folders(default_tokenizer, tmp_path_factory):
    """The base model, two adapters on it, and for each adapter the base with it merged in."""
    root = tmp_path_factory.mktemp("lora_jf")
    base = save_full_vocab_llama(root / "base", default_tokenizer)
    adapters = {
        "a": save_random_adapter(base, root / "a", seed=41, rank=8, targets=ALL_TARGETS),
        "b": save_random_adapter(base, root / "b", seed=42, rank=4, targets=["v_proj", "up_proj"]),
    }
    merged = {}
    for name, path in adapters.items():
        model = peft_model(base, path).merge_and_unload()
        model.save_pretrained(root / f"merged_{name}")
        default_tokenizer.save_pretrained(root / f"merged_{name}")
        merged[name] = str(root / f"merged_{name}")
    return base, adapters, merged


def _chat(tok, text: str) -> list[int]:
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    return tok.encode(rendered, add_special_tokens=False)


def _run(sched, tok, cases: dict[str, tuple[str, str | None]]) -> dict[str, list[int]]:
    """rid -> (prompt, adapter): greedy JSON-schema outputs, all submitted at once (one batch)."""
    for rid, (prompt, lora) in cases.items():
        params = SamplingParams(max_new_tokens=48, temperature=0.0, json_schema=json.dumps(SCHEMA))
        options = RequestOptions(lora=lora)
        sched.handle(GenerateReq(rid=rid, input_ids=_chat(tok, prompt), params=params, options=options))
    ids: dict[str, list[int]] = {rid: [] for rid in cases}
    while sched.has_work():
        for o in sched.step():
            assert o.error is None, o.error
            if o.replaced_tokens:  # jump-forward re-split the end of the text
                del ids[o.rid][len(ids[o.rid]) - o.replaced_tokens :]
            ids[o.rid].extend(o.new_token_ids)
    sched.check_accounting()
    return ids


def test_jump_forward_under_adapters_equals_the_merged_models(folders, default_tokenizer):
    base, adapters, merged = folders
    tok = default_tokenizer
    mods = tuple(f"{n}={p}" for n, p in adapters.items())
    sched = make_scheduler(base, tok, lora_modules=mods, max_loras=2)
    mixed = _run(sched, tok, {f"r-{n}": (PROMPTS[n], n) for n in PROMPTS})
    assert sched.stats["jump_forward_tokens"] > 0
    for name in adapters:
        ref_sched = make_scheduler(merged[name], tok)
        ref = _run(ref_sched, tok, {"ref": (PROMPTS[name], None)})["ref"]
        assert ref_sched.stats["jump_forward_tokens"] > 0
        assert mixed[f"r-{name}"] == ref, (tok.decode(mixed[f"r-{name}"]), tok.decode(ref))
    plain = _run(make_scheduler(base, tok), tok, {"ref": (PROMPTS[None], None)})["ref"]
    assert mixed["r-None"] == plain
    # the adapters matter: the base model's answer to adapter a's prompt differs
    assert _run(make_scheduler(base, tok), tok, {"x": (PROMPTS["a"], None)})["x"] != mixed["r-a"]
    for out in mixed.values():
        jsonschema.validate(json.loads(tok.decode(out, skip_special_tokens=True)), SCHEMA)
