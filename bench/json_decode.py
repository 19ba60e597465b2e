"""JSON-Schema-constrained decoding: jump-forward on vs off (vs the HF baseline with the same grammar masks).

Datasets:
  * `extraction` (default): synthetic city descriptions; the model fills a fixed 7-field schema whose keys and
    punctuation the grammar forces -- the text jump-forward appends without running the model. Accuracy is
    the share of fields equal to the ground truth.
  * `jsonschemabench:<subset>` (Github_trivial, Github_easy, Glaiveai2K): real-world schemas from
    bench/data; the model writes any instance. Accuracy is the share of outputs valid under the schema.
Schemas radixlm's grammar compiler rejects are skipped and counted. The HF side applies the same compiled
grammar (radixlm's `constrained` package) as a logits processor, without jump-forward.

    python -m bench.json_decode --quick
    python -m bench.json_decode --num-items 32 --max-tokens 160
    python -m bench.json_decode --dataset jsonschemabench:Github_easy --num-items 32
"""

from __future__ import annotations

import json
import random
from typing import Any

from bench.harness import common
from bench.harness.datasets import load_subset
from bench.harness.workload import Workload, add_workload_args, compare

CITY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city_name": {"type": "string", "maxLength": 40},
        "country_name": {"type": "string", "maxLength": 40},
        "population_count": {"type": "integer"},
        "year_founded": {"type": "integer"},
        "is_national_capital": {"type": "boolean"},
        "current_mayor_name": {"type": "string", "maxLength": 40},
        "main_industry_sector": {"type": "string", "maxLength": 40},
    },
    "required": [
        "city_name",
        "country_name",
        "population_count",
        "year_founded",
        "is_national_capital",
        "current_mayor_name",
        "main_industry_sector",
    ],
    "additionalProperties": False,
}
_SYLLABLES = "va lor mi den tas ka rin bel o sun tor ae lis gra mon fel ur ia".split()
_FIRST = "Elena Marco Ada Ivan Lina Tomas Sara Omar Nadia Felix".split()
_LAST = "Rossi Novak Berg Costa Haddad Lund Moreau Okafor Silva Varga".split()
_INDUSTRY = "textiles shipping tourism mining software agriculture banking fishing steel wine".split()


def _name(rng: random.Random, parts: int) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(parts)).capitalize()


def city_record(rng: random.Random) -> dict[str, Any]:
    return {
        "city_name": _name(rng, 3),
        "country_name": _name(rng, 2) + "ia",
        "population_count": rng.randint(2_000, 3_000_000),
        "year_founded": rng.randint(800, 1950),
        "is_national_capital": rng.random() < 0.3,
        "current_mayor_name": f"{rng.choice(_FIRST)} {rng.choice(_LAST)}",
        "main_industry_sector": rng.choice(_INDUSTRY),
    }


def describe(rec: dict[str, Any]) -> str:
    capital = (
        "It is the capital of the country."
        if rec["is_national_capital"]
        else "It is not the capital of the country."
    )
    return (
        f"{rec['city_name']} is a city in {rec['country_name']}. It was founded in {rec['year_founded']} and "
        f"today has {rec['population_count']} inhabitants. {capital} The current mayor is "
        f"{rec['current_mayor_name']}, and the main industry is {rec['main_industry_sector']}."
    )


def field_accuracy(truth: dict[str, Any], text: str) -> float:
    """Share of the schema's fields whose extracted value equals the truth (strings compared case-blind)."""
    try:
        got = json.loads(text)
    except json.JSONDecodeError:
        return 0.0
    if not isinstance(got, dict):
        return 0.0
    hits = 0
    for key, want in truth.items():
        value = got.get(key)
        if isinstance(want, str):
            hits += isinstance(value, str) and value.strip().lower() == want.lower()
        else:
            hits += type(value) is type(want) and value == want
    return hits / len(truth)


def schema_valid(schema: dict[str, Any], text: str) -> float:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError, jsonschema.SchemaError):
        return 0.0
    return 1.0


def make_program(max_tokens: int):
    from lang import assistant, function, gen, system, user

    @function
    def json_extract(s, instruction: str, schema: str):
        s += system("You convert text into JSON that follows the given schema.")
        s += user(instruction)
        s += assistant(gen("json", max_tokens=max_tokens, temperature=0, json_schema=schema))

    return json_extract


def extraction_items(num: int, seed: int) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    schema = json.dumps(CITY_SCHEMA)
    items, labels = [], []
    for _ in range(num):
        rec = city_record(rng)
        items.append({"instruction": describe(rec) + "\nExtract the city's facts as JSON.", "schema": schema})
        labels.append(rec)
    return items, labels


def benchmark_items(subset: str, num: int, seed: int) -> tuple[list[dict], list[dict], int]:
    """(items, schemas as labels, rejected count): the first schemas of the subset that compile-check."""
    from constrained import GrammarError, validate_spec

    rows = load_subset(subset)
    random.Random(seed).shuffle(rows)
    items, labels, rejected = [], [], 0
    for row in rows:
        if len(items) >= num:
            break
        text = json.dumps(row["schema"])
        try:
            validate_spec("json_schema", text)
        except GrammarError:
            rejected += 1
            continue
        items.append({"instruction": f"Write one JSON instance of this JSON Schema:\n{text}", "schema": text})
        labels.append(row["schema"])
    return items, labels, rejected


def main(argv: list[str] | None = None) -> dict:
    p = common.base_parser(__doc__.splitlines()[0])
    add_workload_args(p, default_sides="radixlm,radixlm-nojf,hf", num_threads=16)
    p.add_argument("--dataset", default="extraction", help="extraction | jsonschemabench:<subset>")
    p.add_argument("--num-items", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=160)
    args = p.parse_args(argv)
    if args.quick:
        args.num_items, args.max_tokens = 4, 128
    rejected = 0
    if args.dataset == "extraction":
        items, labels = extraction_items(args.num_items, args.seed)
        score = field_accuracy_score
    elif args.dataset.startswith("jsonschemabench:"):
        items, labels, rejected = benchmark_items(args.dataset.split(":", 1)[1], args.num_items, args.seed)
        score = validity_score
    else:
        p.error(f"unknown dataset {args.dataset!r}")
    warm_items, _ = extraction_items(1, args.seed + 1)
    wl = Workload(
        "json_decode",
        make_program(args.max_tokens),
        items,
        labels=labels,
        score=score,
        prediction=lambda s: s["json"],
        warmup_items=warm_items,
        config={
            "dataset": args.dataset,
            "num_items": len(items),
            "rejected_schemas": rejected,
            "max_tokens": args.max_tokens,
            "dtype": args.dtype,
        },
    )
    baseline = "radixlm-nojf" if "radixlm-nojf" in args.sides else None
    return compare(wl, args, baseline=baseline, extra=_jump_forward_stats)


def field_accuracy_score(label: dict[str, Any], state) -> float:
    return field_accuracy(label, state["json"])


def validity_score(label: dict[str, Any], state) -> float:
    return schema_valid(label, state["json"])


def _jump_forward_stats(per_side: dict[str, dict], states: dict[str, list]) -> dict[str, Any]:
    """Tokens appended by jump-forward and decode steps per side (from the server counters)."""
    out = {}
    for name, fig in per_side.items():
        c = fig.get("server_counters")
        if c:
            out[name] = {
                "jump_forward_tokens": c.get("jump_forward_tokens"),
                "decode_steps": c.get("decode_steps"),
                "generated_tokens": c.get("generated_tokens"),
            }
    return {"jump_forward": out}


if __name__ == "__main__":
    main()
