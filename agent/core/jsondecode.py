"""Decoding the API server's JSON (LIST bodies and watch event lines) with ``orjson``,
answering exactly what the standard library's ``json.loads`` answers.

Why: the Kubernetes source decodes every object of the cluster at start (a LIST of 5,000
pods is ~20 MB) and every watch event after; ``json.loads`` was ~17 % of the agent's CPU
per change burst (benchmarks/README.md, issue 28). With ``orjson`` (a well-kept Rust
decoder) and the check below, a 4 KB watch event line decodes in ~45 % less time and a
4 MB LIST body in ~20 % less (its decode is mostly making the Python objects).

Same answers: ``orjson`` refuses some documents the standard library accepts (``NaN``/
``Infinity``, a lone surrogate escape, UTF-16/32 input), and turns an integer outside 64
bits into a float where the standard library keeps it exact. So a document that may hold
an integer of 19 or more digits (:func:`may_hold_big_integer`: one ``bytes.translate`` and
a substring search, ~2 ms per MB, where decoding takes ~15-20 ms per MB) and whatever
``orjson`` refuses are decoded with ``json.loads``: an object with a 100-digit integer is
still one object the store validates and names, never a failed LIST, a broken watch or a
silently rounded number. For every document, the result (or the error) equals
``json.loads``'s (``tests/agent/test_jsondecode.py``).

A run of 19 digits inside a string does not count when what precedes it cannot precede a
number: a LIST of real pods holds an image digest (``sha256:`` and 64 hex digits) and a
container ID per container, and at 1,000 pods some of those hex strings hold 19 decimal
digits in a row; counting them sent the whole pods LIST to the standard library (~40 ms
more at 1,000 pods on the cold start's path, issue 28).
"""

from __future__ import annotations

import json
from typing import Any

try:
    import orjson
except ImportError:  # pragma: no cover - a declared dependency; json alone still works
    orjson = None  # type: ignore[assignment]


# every byte to b" " except the digits, to b"0": a run of 19 zeros is a run of 19 digits
_DIGITS = bytes(0x30 if 0x30 <= b <= 0x39 else 0x20 for b in range(256))
_LONG_RUN = b"0" * 19  # the shortest integer that may not fit orjson's 64 bits
_WHITESPACE = frozenset(b" \t\n\r")
_BEFORE_VALUE = frozenset(b",[:") | _WHITESPACE  # what JSON allows right before a value


def may_hold_big_integer(raw: bytes | bytearray) -> bool:
    """Whether ``raw`` may hold a JSON integer of 19 or more digits: a run of 19 digits
    at the document's start or after what JSON allows before a value (``,``, ``[``,
    whitespace, or ``:`` after a key's closing quote or whitespace; an optional ``-``
    between). Never False for a document that holds one; True for some that do not (a
    run inside a string after a comma or a space), which only costs the slower decoder.
    A run after a letter, a digit-free ``:`` such as ``sha256:`` or a ``/`` is inside a
    string, or is a fraction or an exponent."""
    digits = raw.translate(_DIGITS)
    at = digits.find(_LONG_RUN)
    while at >= 0:  # ``find`` returns the leftmost match: ``at`` starts a digit run
        start = at - 1 if at and raw[at - 1] == 0x2D else at  # "-" of a negative number
        if start == 0:
            return True
        before = raw[start - 1]
        if before in _BEFORE_VALUE and (before != 0x3A or start < 2  # ':'
                                        or raw[start - 2] == 0x22 or raw[start - 2] in _WHITESPACE):
            return True
        end = digits.find(b" ", at)  # past this run: the next one starts after it
        if end < 0:
            return False
        at = digits.find(_LONG_RUN, end)
    return False


def loads(data: bytes | bytearray | memoryview | str) -> Any:
    """Decode one JSON document (the API server's bytes; a ``str`` goes to ``json.loads``
    as is). Raises ``ValueError`` (``json.JSONDecodeError`` or ``UnicodeDecodeError``) for
    a document ``json.loads`` refuses, with its message."""
    if isinstance(data, str):
        return json.loads(data)
    raw = bytes(data) if isinstance(data, memoryview) else data
    if orjson is not None and not may_hold_big_integer(raw):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass  # refused: the standard library decides (and words the error)
    return json.loads(raw)
