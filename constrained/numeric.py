"""Regexes for bounded JSON integers and numbers.

outlines-core 0.2.14 ignores ``minimum``/``maximum``/``exclusive*`` (it emits an unbounded integer or number
regex), so a constrained model could produce out-of-range values. These builders produce regexes whose
matches are exactly the canonical JSON spellings (no leading zeros, no ``-0``, no exponent) of the values in
the range. Fractional number bounds are tightened to integers (``minimum: 0.5`` acts like ``minimum: 1``):
every generated value is valid, a few valid ones become unreachable.
"""

from __future__ import annotations

import math

from constrained.errors import GrammarError

_FRAC = r"(\.[0-9]+)?"  # optional fraction: value stays in [int, int + 1)
_NONZERO_FRAC = r"\.[0-9]*[1-9][0-9]*"  # a fraction that makes the value strictly greater than the int part
_ZERO_FRAC = r"(\.0+)?"  # spellings of exactly the int part
_MAX_DIGITS = 400  # ~1e400 exceeds every float bound; bigger integers are a hostile spec


def _same_length_range(lo: str, hi: str) -> str:
    """Regex for digit strings of len(lo) == len(hi) whose value is in [lo, hi] (leading zeros allowed)."""
    if lo == hi:
        return lo
    if len(lo) == 1:
        return f"[{lo}-{hi}]"
    rest = len(lo) - 1
    if lo[0] == hi[0]:
        return lo[0] + "(" + _same_length_range(lo[1:], hi[1:]) + ")"
    if lo[1:] == "0" * rest and hi[1:] == "9" * rest:
        return f"[{lo[0]}-{hi[0]}][0-9]{{{rest}}}"
    parts = [lo[0] + "(" + _same_length_range(lo[1:], "9" * rest) + ")"]
    first, last = int(lo[0]) + 1, int(hi[0]) - 1
    if first <= last:
        parts.append(f"[{first}-{last}][0-9]{{{rest}}}")
    parts.append(hi[0] + "(" + _same_length_range("0" * rest, hi[1:]) + ")")
    return "|".join(parts)


def natural_range_regex(lo: int, hi: int | None) -> str:
    """Canonical decimal spellings of the naturals in [lo, hi] (hi=None: unbounded).
    Requires 0 <= lo <= hi.
    """
    if lo < 0 or (hi is not None and hi < lo):
        raise ValueError(f"bad natural range [{lo}, {hi}]")
    lo_len = len(str(lo))
    if hi is None:
        # any longer number, then the ones with lo's digit count
        return _alternate([f"[1-9][0-9]{{{lo_len},}}", natural_range_regex(lo, 10**lo_len - 1)])
    hi_len = len(str(hi))
    if max(lo_len, hi_len) > _MAX_DIGITS:
        raise GrammarError(f"numeric bound with more than {_MAX_DIGITS} digits is not supported")
    if lo_len == hi_len:
        return _same_length_range(str(lo), str(hi))
    parts = [_same_length_range("1" + "0" * (hi_len - 1), str(hi))]
    if hi_len - lo_len >= 2:  # every number with a digit count strictly between the two
        parts.append(f"[1-9][0-9]{{{lo_len},{hi_len - 2}}}")
    parts.append(_same_length_range(str(lo), "9" * lo_len))
    return _alternate(parts)


def _alternate(parts: list[str]) -> str:
    parts = [p for p in parts if p]
    return parts[0] if len(parts) == 1 else "|".join(f"({p})" for p in parts)


def integer_range_regex(lo: int | None, hi: int | None) -> str:
    """Canonical JSON integers in [lo, hi] (inclusive; None = unbounded on that side)."""
    if lo is not None and hi is not None and lo > hi:
        raise GrammarError(f"integer bounds are unsatisfiable: minimum {lo} > maximum {hi}")
    parts = []
    if lo is None or lo < 0:  # negative values: magnitudes in [max(1, -hi), -lo]
        mag_lo = 1 if hi is None or hi >= 0 else -hi
        parts.append("-(" + natural_range_regex(mag_lo, None if lo is None else -lo) + ")")
    if hi is None or hi >= 0:
        parts.append(natural_range_regex(max(lo or 0, 0), hi))
    return _alternate(parts)


def _nonneg_number_regex(lo: int, lo_incl: bool, hi: int | None, hi_incl: bool) -> str:
    """Non-negative decimals v with lo <(=) v <(=) hi, for integer endpoints 0 <= lo <= hi."""
    if hi is not None and lo == hi:
        return f"{lo}{_ZERO_FRAC}" if lo_incl and hi_incl else ""
    parts = []  # longest int parts first (see the module docstring)
    if hi is not None and hi_incl:
        parts.append(f"{hi}{_ZERO_FRAC}")
    if hi is None or lo + 1 <= hi - 1:
        parts.append("(" + natural_range_regex(lo + 1, None if hi is None else hi - 1) + ")" + _FRAC)
    parts.append(f"{lo}" + (_FRAC if lo_incl else _NONZERO_FRAC))  # int part == lo: value in [lo, lo + 1)
    return _alternate(parts)


def number_range_regex(lo: float | None, lo_excl: bool, hi: float | None, hi_excl: bool) -> str:
    """Decimal JSON numbers (no exponent) in the range; bounds None = unbounded."""
    if lo is not None and not math.isfinite(lo) or hi is not None and not math.isfinite(hi):
        raise GrammarError("numeric bounds must be finite numbers")
    if lo is not None and hi is not None and (lo > hi or lo == hi and (lo_excl or hi_excl)):
        raise GrammarError(f"number bounds are unsatisfiable: minimum {lo} > maximum {hi}")
    # tighten fractional endpoints to integers (sound: only shrinks the accepted set)
    ilo = ihi = None
    if lo is not None:
        ilo = math.ceil(lo)
        lo_excl = lo_excl and ilo == lo
    if hi is not None:
        ihi = math.floor(hi)
        hi_excl = hi_excl and ihi == hi
    if ilo is not None and ihi is not None and (ilo > ihi or ilo == ihi and (lo_excl or hi_excl)):
        raise GrammarError(
            f"number range [{lo}, {hi}] is narrower than the supported precision (bounds are rounded inward "
            "to integers)"
        )
    parts = []
    if ilo is None or ilo < 0:  # v = -m with m > 0 and -hi <(=) m <(=) -lo
        if ihi is not None and ihi < 0:
            m_lo, m_lo_incl = -ihi, not hi_excl
        else:
            m_lo, m_lo_incl = 0, False
        neg = _nonneg_number_regex(m_lo, m_lo_incl, None if ilo is None else -ilo, not lo_excl)
        if neg:
            parts.append(f"-({neg})")
    if ihi is None or ihi > 0 or ihi == 0 and not hi_excl:
        if ilo is None or ilo < 0:
            p_lo, p_lo_incl = 0, True
        else:
            p_lo, p_lo_incl = ilo, not lo_excl
        pos = _nonneg_number_regex(p_lo, p_lo_incl, ihi, not hi_excl)
        if pos:
            parts.append(pos)
    if not parts:
        raise GrammarError(f"number bounds are unsatisfiable: [{lo}, {hi}]")
    return _alternate(parts)
