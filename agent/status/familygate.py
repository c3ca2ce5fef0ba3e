"""Envoy's text stats body passed through family by family, without parsing a sample.

The merged scrape (:mod:`agent.status.metrics_merge`) streams Envoy's multi-megabyte
``/stats/prometheus`` body straight to the client; what it must still do is cut the
families that may not appear: a metric name an earlier source of the response already
holds (the agent's own registry; :class:`agent.status.exposition.Claims`). A family
Envoy's body declares twice (two separate groups) keeps every sample: the second
group's ``# HELP``/``# TYPE`` lines are cut, its samples stay (a text parser files
them under the family by name). :class:`FamilyGate` decides that
from the ``# HELP``/``# TYPE`` lines alone; :class:`LineAligned` feeds it a body that
arrives in arbitrary chunks as line-aligned pieces, copying only the line that
straddles two chunks.

Cost (``benchmarks/bench_status.py``): the normal case, nothing cut, is a memchr scan
for ``#`` plus set operations on the chunk's metadata names, and the chunk is written
uncopied.
"""

from __future__ import annotations

import re

from agent.status import exposition as ex

# Metadata lines are located with bytes.find (memchr) on "#", rare in a stats body and
# ~4x faster than a regex scan of every byte; the keys are then pulled out of just those
# lines by one C-level findall. _META_AT checks one line start (the slow path).
_META_AT = re.compile(rb"# ((?:HELP|TYPE) \S+)")
_META_RE = re.compile(rb"\n# ((?:HELP|TYPE) \S+)")

def _metadata_lines(data: bytes, end: int, start: int = 0) -> list[tuple[int, bytes]]:
    """``(offset, b"TYPE <name>" | b"HELP <name>")`` of every metadata line in
    ``data[start:end]`` (``start`` is a line start), in order."""
    find, match = data.find, _META_AT.match
    found = []
    i = find(b"#", start, end)
    while i >= 0:
        if i == start or data[i - 1] == 0x0A:  # "#" at a line start
            m = match(data, i, end)
            if m:
                found.append((i, m.group(1)))
        i = find(b"#", i + 1, end)
    return found


def _metadata_keys(data: bytes, end: int, start: int = 0) -> list[bytes]:
    """``b"TYPE <name>"``/``b"HELP <name>"`` of every metadata line in ``data[start:end]``
    (``start`` is a line start), in order. Per ``#`` only two finds and a slice; the
    matching runs in C."""
    find = data.find
    lines = []
    i = find(b"#", start, end)
    while i >= 0:
        j = find(b"\n", i, end)
        if j < 0:
            j = end
        # From the byte before "#": "\n# TYPE ..." only when the "#" starts a line.
        lines.append(data[i - 1:j] if i > start else b"\n" + data[i:j])
        i = find(b"#", j, end)
    return _META_RE.findall(b"\n".join(lines)) if lines else []


def _new_block(key: bytes, last: bytes) -> bool:
    """A metadata line starts a new family block unless it is the other half (HELP after
    TYPE or TYPE after HELP) of the block the previous metadata line began; the same line
    twice is a second block."""
    return key == last or key[5:] != last[5:]


class FamilyGate:
    """Cuts, from a text body streamed in line-aligned chunks, whole families that may not
    appear: a name an earlier source of the response holds
    (:class:`agent.status.exposition.Claims`); of a family this body declares a second
    time only the repeated metadata lines are cut (its samples are kept).

    Only metadata lines are looked at: a block runs from a ``# HELP``/``# TYPE`` line to
    the next metadata line of another name (Envoy declares every family; its samples
    follow their TYPE line). The fast path (nothing cut, the normal case) costs a memchr
    scan plus set operations on the chunk's metadata names and returns the chunk uncopied.
    """

    def __init__(self, claims: ex.Claims, source: str):
        self.claims = claims
        self.source = source
        self._seen: set[bytes] = set()  # names of this body's TYPE lines / blocks so far
        self._help_seen: set[bytes] = set()  # names of its HELP lines / blocks so far
        self._last = b""  # the last metadata key (b"TYPE name") seen
        self._cutting = False  # its block is being cut (it may go on in the next chunk)
        self._merging = False  # its block repeats a kept family: metadata lines cut only
        self._dropped: set[bytes] = set()  # names of blocks cut as another source's

    def filter(self, data: bytes, end: int | None = None, start: int = 0
               ) -> bytes | memoryview:
        """``data[start:end]`` (``start`` a line start, ``end`` just after a newline)
        without the cut families: ``data`` itself (or a memoryview of the range) when
        nothing is cut, else a new bytes."""
        end = len(data) if end is None else end
        whole = data if start == 0 and end == len(data) else memoryview(data)[start:end]
        keys = _metadata_keys(data, end, start)
        if not keys:
            if self._cutting:
                return b""
            return whole
        if not self._cutting:
            types = [k[5:] for k in keys if k[0] == 84]  # b"TYPE ..."
            helps = [k[5:] for k in keys if k[0] != 84]
            tset, hset = set(types), set(helps)
            if (len(tset) == len(types) and len(hset) == len(helps)
                    and tset.isdisjoint(self._seen) and hset.isdisjoint(self._help_seen)):
                if not self.claims.admit_text_names(tset | hset, self.source):
                    self._seen |= tset
                    self._help_seen |= hset
                    self._last = keys[-1]
                    return whole
        return self._cut(data, end, start)

    def _cut(self, data: bytes, end: int, begin: int = 0) -> bytes:
        """The slow path: walk the metadata lines, drop cut blocks up to the next kept one."""
        out = []
        keep_from = None if self._cutting else begin
        for start, key in _metadata_lines(data, end, begin):
            new, self._last = _new_block(key, self._last), key
            if new:
                name = key[5:]
                if name in self._seen or name in self._help_seen:
                    drop = name in self._dropped
                    self._merging = not drop  # a second group of a kept family
                else:
                    drop = bool(self.claims.admit_text_names({name}, self.source))
                    self._merging = False
                    if drop:
                        self._dropped.add(name)
                self._seen.add(name)
                self._help_seen.add(name)
            elif not self._merging:
                continue  # the same block goes on (its HELP, then its TYPE)
            if self._merging:  # only its metadata line goes: the samples join the family
                if keep_from is not None:
                    out.append(data[keep_from:start])
                line_end = data.find(b"\n", start, end)
                keep_from = end if line_end < 0 else line_end + 1
                continue
            if drop and keep_from is not None:
                out.append(data[keep_from:start])
                keep_from = None
            elif not drop and keep_from is None:
                keep_from = start
        if keep_from is not None:
            out.append(data[keep_from:end])
        self._cutting = keep_from is None
        return b"".join(out)


class LineAligned:
    """Feeds a body arriving in arbitrary chunks to a :class:`FamilyGate` in line-aligned
    pieces, copying only the line that straddles two chunks: :meth:`feed` returns the
    parts to write for one chunk (that line completed, then the rest of the chunk up to
    its last newline, uncopied), :meth:`close` the unfinished last line (a newline added)."""

    def __init__(self, gate: FamilyGate):
        self.gate = gate
        self._tail = b""  # the unfinished last line of the previous chunk

    def feed(self, chunk: bytes) -> list[bytes | memoryview]:
        cut = chunk.rfind(b"\n") + 1
        if not cut:
            self._tail += chunk
            return []
        parts = []
        start = 0
        if self._tail:  # that line ends in this chunk
            start = chunk.find(b"\n") + 1
            parts.append(self.gate.filter(self._tail + chunk[:start]))
        if cut > start:
            parts.append(self.gate.filter(chunk, cut, start))
        self._tail = chunk[cut:]
        return [p for p in parts if len(p)]

    def close(self) -> list[bytes | memoryview]:
        if not self._tail:
            return []
        part, self._tail = self.gate.filter(self._tail + b"\n"), b""
        return [part] if len(part) else []
