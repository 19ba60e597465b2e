"""Sampling keyword arguments of the DSL, mapped onto `runtime.sampling_params.SamplingParams`.

The field list lives only in `SamplingParams`; this module adds the DSL's aliases (`max_tokens`) and validates
a partial set of kwargs the same way the server will, so a typo fails where the program is written rather
than as an HTTP 400 later. Only the keys a program sets are sent: the server applies its own defaults.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from runtime.sampling_params import SamplingParams

SAMPLING_FIELDS: frozenset[str] = frozenset(f.name for f in dataclasses.fields(SamplingParams))
# DSL/OpenAI spelling -> SamplingParams field.
ALIASES: dict[str, str] = {"max_tokens": "max_new_tokens"}


def is_sampling_key(name: str) -> bool:
    return name in SAMPLING_FIELDS or name in ALIASES


def normalize(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Map aliases, drop None values ("not set"), reject unknown names and invalid values.

    Returns a dict keyed by SamplingParams field names. A `json_schema` given as a dict is kept as JSON text.
    Raises ValueError naming the offending field.
    """
    out: dict[str, Any] = {}
    for key, value in kwargs.items():
        if value is None:
            continue
        name = ALIASES.get(key, key)
        if name not in SAMPLING_FIELDS:
            known = ", ".join(sorted(SAMPLING_FIELDS | set(ALIASES)))
            raise ValueError(f"unknown sampling parameter {key!r} (known: {known})")
        if name in out and key in ALIASES:
            raise ValueError(f"both {key!r} and {name!r} given")
        out[name] = value
    # Validate with the server's own rules; keep the normalized forms (stop as a list, schema as text).
    checked = SamplingParams.from_dict(out)
    return {name: getattr(checked, name) for name in out}


def merge(defaults: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Per-call values win over program-level defaults; both are already normalized."""
    return {**defaults, **overrides}
