r"""Regexes for JSON Schema ``format`` values, and for length-bounded strings, that compile to small automata.

Every regex here matches only valid instances (checked by random walks in
tests/unit/test_constrained_formats.py against Python's own parsers and ``jsonschema``'s format checker), at
the price of documented relaxations: not every valid instance is reachable.

* date: years 1000-9999; February stops at the 28th (no leap-day logic). time: seconds 00-59 (no leap second),
  fractions of 3 or 6 digits, a ``Z`` or ``+hh:mm`` offset always present (RFC 3339 requires one).
* email, hostname, uri: lowercase ASCII hostnames of at most 5 labels of 1-22 characters; email local parts
  of ``[a-z0-9_+-]`` words; uri is ``http(s)://host[:port][/path][?query][#fragment]`` with at most 4 path
  segments and bounded part lengths. Bounded so the texts have a known longest length (``format_width``),
  which lets ``maxLength`` be checked against the format instead of being dropped.
* bounded strings (``minLength``/``maxLength``): counted characters are printable ASCII but ``"`` and ``\\``,
  no JSON escapes. Measured at vocab 49152 (2 cores, load average ~12): outlines-core's own ``{0,16}`` of its
  Unicode class with escapes took ~50 s; with the escape alternative, even ASCII ``{0,16}`` takes 1.8 s and
  ``{0,32}`` minutes; plain ASCII ``{0,64}`` takes ~1 s and ``{256}`` ~7 s.

* patterns: a counted repeat above STRING_LENGTH_CAP is lowered to it; with ``minLength``/``maxLength`` the
  pattern is kept and made to imply the bounds (``pattern_within_length``), or the pair is a GrammarError.

Formats outlines-core ships are not used: its ``date-time``/``time`` accept a missing offset and ``date``
accepts February 31st, which ``jsonschema`` rejects.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

try:  # Python >= 3.11; sre_parse is its deprecated alias
    from re import _parser as sre_parse
except ImportError:  # pragma: no cover
    import sre_parse

from constrained.errors import GrammarError

_YEAR = "[1-9][0-9]{3}"
_MONTH_DAY = (
    "(?:(?:0[1-9]|1[0-2])-(?:0[1-9]|1[0-9]|2[0-8])|(?:0[13-9]|1[0-2])-(?:29|30)|(?:0[13578]|1[02])-31)"
)
_DATE = f"{_YEAR}-{_MONTH_DAY}"
_TIME = (
    "(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\\.[0-9]{3}(?:[0-9]{3})?)?"
    "(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
)
_LABEL = "[a-z0-9](?:[a-z0-9-]{0,20}[a-z0-9])?"
_HOSTNAME = f"{_LABEL}(?:\\.{_LABEL}){{0,4}}"
_OCTET = "(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
_URI_CHAR = "[A-Za-z0-9._~!$&'()*+,;=:@-]"  # RFC 3986 pchar without %-escapes
_URI = (
    f"https?://{_HOSTNAME}(?::[1-9][0-9]{{0,3}})?(?:/{_URI_CHAR}{{0,16}}){{0,4}}"
    f"(?:\\?[A-Za-z0-9._~!$&'()*+,;=:@/?-]{{0,24}})?(?:#[A-Za-z0-9._~!$&'()*+,;=:@/?-]{{0,8}})?"
)
_EMAIL = (
    f"[a-z0-9_+-]{{1,32}}(?:\\.[a-z0-9_+-]{{1,16}}){{0,2}}@{_LABEL}(?:\\.{_LABEL}){{0,3}}\\.[a-z]{{2,10}}"
)

FORMAT_REGEXES: dict[str, str] = {
    "date-time": f"{_DATE}T{_TIME}",
    "date": _DATE,
    "time": _TIME,
    "uuid": "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
    "email": _EMAIL,
    "hostname": _HOSTNAME,
    "ipv4": f"{_OCTET}(?:\\.{_OCTET}){{3}}",
    "uri": _URI,
    "json-pointer": "(?:/(?:[ !#-.0-\\[\\]-}]|~[01])*)*",
}
# Standard formats (JSON Schema 2020-12, 7.3) we cannot express: a request using one gets a 400. Any other
# value is a custom annotation ("url", "non-blank", "int64", ...) that no validator assigns a meaning to, so
# it is ignored, as the specification says unknown formats must be.
UNSUPPORTED_FORMATS = frozenset(
    {
        "duration",
        "idn-email",
        "idn-hostname",
        "ipv6",
        "uri-reference",
        "iri",
        "iri-reference",
        "uri-template",
        "relative-json-pointer",
        "regex",
    }
)

# The longest valid text of a format, in characters, where an RFC fixes one. llguidance's format regexes
# bound no length (its email is `local@label(.label)*`, its hostname any number of labels), so a small model
# can write one for ever; the llguidance paths add it as `maxLength` (``cap_format_length``). The regexes
# above are bounded already. Formats llguidance accepts and left unbounded on purpose: `date-time` / `time`
# (RFC 3339 5.6: time-secfrac is "." 1*DIGIT, no limit), `duration` (RFC 3339 appendix A: 1*DIGIT per
# field), `uri` (RFC 3986 sets no overall limit; its 3.2.2 only recommends, "should", 255 characters for a
# host name); `date`, `ipv4`, `ipv6` and `uuid` are bounded by their own syntax.
FORMAT_MAX_LENGTHS: dict[str, int] = {
    # RFC 5321 4.5.3.1.3: a forward-path is at most 256 octets, its angle brackets included: 254 for the
    # mailbox (RFC 3696 erratum 1690 says the same). ASCII only, so characters are octets.
    "email": 254,
    # RFC 6531 extends RFC 5321's Mailbox to UTF-8 and keeps its limits, which count octets: a character
    # is at least one, so 254 characters is an upper bound (llguidance 1.9 does not know this format).
    "idn-email": 254,
    # RFC 1035 2.3.4 (and RFC 1123 2.1): at most 255 octets on the wire, i.e. 253 characters of dotted text.
    "hostname": 253,
    # IDNA (RFC 5890) puts a name into the DNS in its A-label (ASCII) form, so RFC 1035's limit applies to
    # that form, and a U-label is never longer than its A-label (llguidance 1.9 does not know this format).
    "idn-hostname": 253,
}


def cap_format_length(node: dict) -> dict:
    """``node`` with ``maxLength`` lowered to its ``format``'s RFC limit (FORMAT_MAX_LENGTHS); a schema's
    own smaller ``maxLength`` and its ``minLength`` are kept (the bounds intersect). Unchanged (the same
    object) without such a format, where ``const`` / ``enum`` fix the values already, where the length
    bounds are not plain integers (the backend names the error), and where ``minLength`` is above the
    limit (the schema is left as written rather than made unsatisfiable)."""
    limit = FORMAT_MAX_LENGTHS.get(node.get("format")) if isinstance(node.get("format"), str) else None
    if limit is None or "const" in node or "enum" in node:
        return node
    bounds = [node.get(k, 0) for k in ("minLength", "maxLength")]
    if not all(isinstance(b, int) and not isinstance(b, bool) for b in bounds) or bounds[0] > limit:
        return node
    if "maxLength" in node and node["maxLength"] <= limit:
        return node
    return {**node, "maxLength": limit}


# One counted character of a bounded string: printable ASCII but `"` and `\` (one character for
# minLength/maxLength, escapes excluded: they multiply compile time, see above).
ASCII_STRING_CHAR = r"[ !#-\[\]-~]"
STRING_CHAR = r'(?:[^"\\\x00-\x1F\x7F-\x9F]|\\["\\/bfnrt])'  # outlines-core's set, for unbounded tails
# Longest maxLength compiled as is; a larger one is lowered to it (output stays valid: shorter strings).
# Measured cost at vocab 49152: ~1 DFA state per counted ASCII character.
STRING_LENGTH_CAP = 64
# minLength above this is refused (400): the required characters cannot be relaxed away.
MAX_MIN_LENGTH = 256


def format_regex(name: str) -> str | None:
    """The regex of a string ``format`` (no quotes), None for a custom format (ignored).
    Raises GrammarError for a standard format that cannot be enforced."""
    if name in FORMAT_REGEXES:
        return FORMAT_REGEXES[name]
    if name in UNSUPPORTED_FORMATS:
        supported = ", ".join(sorted(FORMAT_REGEXES))
        raise GrammarError(f"format {name!r} cannot be enforced (supported formats: {supported})")
    return None


@functools.cache
def format_width(name: str) -> tuple[int, int]:
    """(shortest, longest) length in characters of the texts ``format_regex(name)`` matches."""
    lo, hi = sre_parse.parse(FORMAT_REGEXES[name]).getwidth()
    return int(lo), int(hi)


def bounded_string_regex(min_length: int, max_length: int | None) -> str:
    """A JSON string (quotes included) of ``min_length``..``max_length`` characters (None: no maximum).

    Raises GrammarError when ``min_length`` exceeds MAX_MIN_LENGTH or the bounds cannot be met; a maximum
    above STRING_LENGTH_CAP is lowered to max(STRING_LENGTH_CAP, min_length).
    """
    if min_length < 0 or (max_length is not None and max_length < min_length):
        raise GrammarError(
            f"string length bounds are unsatisfiable: minLength {min_length} > maxLength {max_length}"
        )
    if min_length > MAX_MIN_LENGTH:
        raise GrammarError(
            f"minLength {min_length} is above the supported limit of {MAX_MIN_LENGTH} (the automaton would "
            "be too large)"
        )
    if max_length is None:
        return f'"{ASCII_STRING_CHAR}{{{min_length}}}{STRING_CHAR}*"'
    max_length = min(max_length, max(STRING_LENGTH_CAP, min_length))
    return f'"{ASCII_STRING_CHAR}{{{min_length},{max_length}}}"'


def pattern_within_length(pattern: str, min_length: int, max_length: int | None) -> str:
    """``pattern`` (anchors stripped) rewritten so that every text it matches has ``min_length`` to
    ``max_length`` characters: outlines-core, given both, kept the length and dropped the pattern (invalid
    outputs; and its counted Unicode string with escapes took > 120 s to compile at maxLength 24).

    When the pattern's own texts are all long enough and short enough it is returned as is. When some are
    too long, its unbounded repeats (``*``, ``+``, ``{n,}``) get the largest common bound that fits
    (stricter: output stays valid; ``max_length`` is first lowered to STRING_LENGTH_CAP as for plain
    strings). GrammarError when the pattern admits texts shorter than ``min_length`` (a length check cannot
    be added to a regex) or Python cannot measure it.
    """
    if min_length > MAX_MIN_LENGTH:
        raise GrammarError(f"minLength {min_length} is above the supported limit of {MAX_MIN_LENGTH}")
    try:
        lo, hi = (int(w) for w in sre_parse.parse(pattern).getwidth())
    except Exception as err:  # a Rust-only construct (\p{..}, ...): its length is unknown
        raise GrammarError(
            f"`pattern` with minLength/maxLength: cannot measure {pattern!r} ({err})"
        ) from None
    if lo < min_length and (widened := _widen_single_repeat(pattern, min_length)) is not None:
        return pattern_within_length(widened, min_length, max_length)
    if lo < min_length:
        raise GrammarError(
            f"`pattern` {pattern!r} admits texts of {lo} characters, shorter than minLength {min_length}: "
            "the pair cannot be enforced"
        )
    if max_length is None or hi <= max_length:
        return pattern
    limit = max(min(max_length, STRING_LENGTH_CAP), min_length)
    bound = limit
    while bound >= 1:
        bounded = _bound_repeats(pattern, bound)
        try:
            lo2, hi2 = (int(w) for w in sre_parse.parse(bounded).getwidth())
        except Exception:
            break
        if hi2 <= limit and lo2 >= min_length:
            return bounded
        bound //= 2
    raise GrammarError(
        f"`pattern` {pattern!r} admits texts longer than maxLength {max_length} and cannot be bounded to it"
    )


def _bound_repeats(pattern: str, bound: int) -> str:
    """``pattern`` with ``*`` -> ``{0,bound}``, ``+`` -> ``{1,bound}``, ``{n,}`` -> ``{n,max(n,bound)}``."""
    return _rewrite_repeats(pattern, lambda lo, hi: (lo, max(lo, bound)) if hi is None else (lo, hi))


def cap_pattern_repeats(pattern: str) -> str:
    """``pattern`` with each counted repeat ``{n,m}`` whose m is above STRING_LENGTH_CAP lowered to
    ``{n,max(n,STRING_LENGTH_CAP)}``: stricter, so output stays valid (``[0-9a-zA-Z_-]{1,255}`` made a compile
    worker pass its 2 GB memory cap)."""
    cap = STRING_LENGTH_CAP
    return _rewrite_repeats(
        pattern, lambda lo, hi: (lo, max(lo, cap)) if hi is not None and hi > cap else (lo, hi)
    )


# A pattern that is one repeated atom: a class, an escape, `.` or a plain character, then its quantifier.
_ONE_REPEAT = re.compile(r"(\[(?:\\.|[^\]\\])+\]|\\.|\.|[^\\\[\](){}|*+?^$])(\*|\+|\{\d+(?:,\d*)?\})")


def _widen_single_repeat(pattern: str, min_length: int) -> str | None:
    """``X*`` / ``X+`` / ``X{n,m}`` with its count raised to at least ``min_length`` (exact: the count is the
    text's length), None when ``pattern`` is not one repeated atom."""
    m = _ONE_REPEAT.fullmatch(pattern)
    if m is None:
        return None
    count_hi = re.search(r"\{\d+,(\d+)\}$|\{(\d+)\}$", pattern)
    if count_hi and int(count_hi.group(1) or count_hi.group(2)) < min_length:
        return None  # its longest text is still too short
    return _rewrite_repeats(pattern, lambda lo, hi: (max(lo, min_length), hi))


def _rewrite_repeats(pattern: str, bounds: Callable[[int, int | None], tuple[int, int | None]]) -> str:
    """``pattern`` with every quantifier ``*``, ``+``, ``{n}``, ``{n,}``, ``{n,m}`` (outside character classes
    and escapes) replaced by ``{lo,hi}`` from ``bounds(lo, hi)`` (hi None: unbounded)."""
    out: list[str] = []
    i, in_class = 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            out.append(pattern[i : i + 2])
            i += 2
            continue
        quant, end = None, i + 1
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            out.append(c)
            i += 1
            for literal in ("^", "]"):  # a leading ^ and/or ] do not end the class
                if pattern.startswith(literal, i):
                    out.append(literal)
                    i += 1
            continue
        elif c in "*+":
            quant = (0 if c == "*" else 1, None)
        elif c == "{":
            m = re.match(r"\{(\d+)(,(\d*))?\}", pattern[i:])
            if m:
                lo = int(m.group(1))
                quant = (lo, lo if m.group(2) is None else (int(m.group(3)) if m.group(3) else None))
                end = i + m.end()
        if quant is None:
            out.append(c)
            i += 1
            continue
        lo, hi = bounds(*quant)
        if (lo, hi) == quant:
            out.append(pattern[i:end])
        else:
            out.append(f"{{{lo},{'' if hi is None else hi}}}" if hi != lo else f"{{{lo}}}")
        i = end
    return "".join(out)
