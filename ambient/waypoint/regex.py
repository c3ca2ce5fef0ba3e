"""Whether Envoy will take a regular expression of a route match (``safe_regex``), checked
with RE2 itself (the ``google-re2`` binding of the engine Envoy compiles them with), so a
route carrying one Envoy would reject is never sent: Envoy NACKs a whole
``RouteConfiguration`` for one bad regex.

Envoy refuses a pattern that RE2 cannot parse (backreferences, lookaround, unbalanced
groups ...) and one whose compiled program is larger than 100 instructions (its default
``re2.max_program_size.error_level``).
"""

from __future__ import annotations

import functools

import re2

#: Envoy's default ``re2.max_program_size.error_level``
MAX_PROGRAM_SIZE = 100

_OPTIONS = re2.Options()
_OPTIONS.log_errors = False  # the reason is returned, not printed by RE2


@functools.lru_cache(maxsize=4096)
def problem(pattern: str) -> str | None:
    """None when Envoy accepts ``pattern``, else why not (text for a warning)."""
    try:
        size = re2.compile(pattern, _OPTIONS).programsize
    except re2.error as e:
        reason = e.args[0] if e.args else e
        if isinstance(reason, bytes):
            reason = reason.decode(errors="replace")
        return f"is not an RE2 regular expression ({reason})"
    if size > MAX_PROGRAM_SIZE:
        return (f"compiles to {size} RE2 instructions, more than Envoy's limit of "
                f"{MAX_PROGRAM_SIZE}")
    return None
