"""Metric families across the two exposition formats, and the naming rules of one merged
response (``/stats/prometheus``).

Parsing and rendering are prometheus-client's; what lives here is what it does not do:

- **Sample names never change.** prometheus-client's text parser renames the samples of a
  counter declared without ``_total`` (``foo`` becomes ``foo_total``; Envoy declares ~190
  such counters, e.g. ``envoy_cluster_upstream_rq``) so a re-rendered body would rename
  series. :func:`parse_text` reads those families as untyped instead.
- **One body valid for its content type, and for Prometheus' own text parser.** A text
  body gets only text types (:func:`for_text` lowers OpenMetrics ``info``, ``stateset``,
  ``gaugehistogram`` and ``_created`` samples to gauges, as prometheus-client's text
  writer does). An OpenMetrics body gets only the types both the OpenMetrics parser and
  a text parser such as ``promtool check metrics`` accept (:func:`for_openmetrics`:
  counter, gauge, histogram, summary; ``unknown`` families are written without a
  ``# TYPE`` line, which both read as untyped), ``le``/``quantile`` in canonical form.
- **First source wins.** :class:`Claims` holds the names a response already uses, in the
  source order agent → Envoy → applications (the order upstream writes them). A later
  family that would reuse one is dropped whole and counted: two families with one name
  make Prometheus reject the scrape (text: "second TYPE line"; OpenMetrics: "Clashing
  name"), and the same series from two sources is a duplicate. Upstream concatenates and
  leaves this to the user; the policy is ours.
- Within one source, an OpenMetrics counter/histogram/summary whose reserved names
  (``foo`` for counter ``foo_total``) are another family's sample names is split into
  ``unknown`` families named after its samples, so both survive: Envoy's
  ``envoy_cluster_upstream_rq{envoy_response_code=...}`` next to
  ``envoy_cluster_upstream_rq_total``.

Everything here is CPU-bound and synchronous; the merger runs it off the event loop.
"""

from __future__ import annotations

import re
from typing import Iterable

from prometheus_client.exposition import generate_latest as _text_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.exposition import generate_latest as _om_latest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as _om_parse
from prometheus_client.parser import text_string_to_metric_families as _text_parse
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

# OpenMetrics: the names a family of each type reserves besides its own name
# (prometheus-client's strict parser checks exactly these for clashes).
OM_SUFFIXES = {
    "counter": ("_total", "_created"),
    "summary": ("_count", "_sum", "_created"),
    "histogram": ("_count", "_sum", "_bucket", "_created"),
    "gaugehistogram": ("_gcount", "_gsum", "_bucket"),
    "info": ("_info",),
}
# Prometheus text: the sample names a family of each type owns besides its own name.
TEXT_SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}
_COUNTER_TYPE_RE = re.compile(rb"^# TYPE[ \t]+(\S+)[ \t]+counter[ \t]*$", re.M)
_UNKNOWN_TYPE_RE = re.compile(rb"^# TYPE \S+ unknown\n", re.M)
_EOF_RE = re.compile(rb"(?:^|\n)# EOF[ \t\r\n]*\Z")


def parse_text(body: bytes) -> list[Metric]:
    """A Prometheus text (0.0.4) body as families, every sample name as written.

    A counter declared without ``_total`` is read as untyped (see the module docstring).
    Raises ValueError (also for bytes that are not UTF-8) when the body does not parse.
    """

    def untyped(m: re.Match) -> bytes:
        name = m.group(1)
        return m.group(0) if name.endswith(b"_total") else b"# TYPE " + name + b" untyped"

    text = _COUNTER_TYPE_RE.sub(untyped, body).decode("utf-8")
    return list(_text_parse(text))


def merge_groups(families: list[Metric]) -> list[Metric]:
    """``families`` with every later family of an earlier one's name and type merged into
    it (samples appended in order, at the first one's place): Envoy may emit one family in
    two separate groups, which a parser reads as two families. A repeat of another type
    is left as it is (the first still wins at :meth:`Claims.admit`). New objects; the
    input is not changed."""
    first: dict[tuple[str, str], Metric] = {}
    out: list[Metric] = []
    for fam in families:
        held = first.get((fam.name, fam.type))
        if held is not None:
            held.samples.extend(fam.samples)
            continue
        fam = _metric(fam.name, fam.documentation, fam.type, fam.samples, fam.unit)
        first[(fam.name, fam.type)] = fam
        out.append(fam)
    return out


def parse_openmetrics(body: bytes) -> list[Metric]:
    """An OpenMetrics body (with its ``# EOF``) as families, by prometheus-client's strict
    parser. Raises ValueError naming the first problem."""
    return list(_om_parse(body.decode("utf-8")))


def _metric(name: str, documentation: str, typ: str, samples: Iterable[Sample],
            unit: str = "") -> Metric:
    m = Metric(name, documentation, typ, unit)
    m.samples = list(samples)
    return m


def _by_sample_name(fam: Metric, typ: str) -> list[Metric]:
    """``fam`` split into one family of type ``typ`` per distinct sample name, in order."""
    groups: dict[str, list[Sample]] = {}
    for s in fam.samples:
        groups.setdefault(s.name, []).append(s)
    return [_metric(name, fam.documentation, typ, samples) for name, samples in groups.items()]


def for_text(families: Iterable[Metric]) -> list[Metric]:
    """Families whose text rendering keeps every sample name and uses text types only:
    ``_created`` samples become gauges of their own, ``info`` a gauge ``<name>_info``,
    ``stateset`` a gauge, ``gaugehistogram`` gauges per sample name."""
    out: list[Metric] = []
    for fam in families:
        typ = fam.type
        if typ == "info":
            out.append(_metric(fam.name + "_info", fam.documentation, "gauge", fam.samples))
        elif typ == "stateset":
            out.append(_metric(fam.name, fam.documentation, "gauge", fam.samples))
        elif typ == "gaugehistogram":
            out.extend(_by_sample_name(fam, "gauge"))
        elif typ in ("counter", "histogram", "summary"):
            created = [s for s in fam.samples if s.name == fam.name + "_created"]
            rest = [s for s in fam.samples if s.name != fam.name + "_created"]
            out.append(_metric(fam.name, fam.documentation, typ, rest))
            if created:
                out.append(_metric(fam.name + "_created", fam.documentation, "gauge", created))
        elif typ == "unknown":
            out.append(_metric(fam.name, fam.documentation, "untyped", fam.samples))
        else:
            out.append(fam)
    return out


def _canonical(samples: list[Sample], label: str) -> list[Sample]:
    out = []
    for s in samples:
        value = s.labels.get(label)
        if value is not None:
            try:
                canon = floatToGoString(float(value))
            except ValueError:
                canon = value  # the OpenMetrics parser will name it
            if canon != value:
                s = s._replace(labels={**s.labels, label: canon})
        out.append(s)
    return out


def for_openmetrics(families: Iterable[Metric]) -> list[Metric]:
    """Families valid both as OpenMetrics and for a Prometheus text parser: untyped
    becomes ``unknown`` (rendered without a TYPE line), ``info`` a gauge
    ``<name>_info``, ``stateset`` a gauge, ``gaugehistogram`` unknown families per
    sample name; ``le`` and ``quantile`` values in canonical float form (``1`` →
    ``1.0``), as OpenMetrics requires."""
    out: list[Metric] = []
    for fam in families:
        typ = fam.type
        if typ == "untyped":
            out.append(_metric(fam.name, fam.documentation, "unknown", fam.samples))
        elif typ == "info":
            out.append(_metric(fam.name + "_info", fam.documentation, "gauge", fam.samples))
        elif typ == "stateset":
            out.append(_metric(fam.name, fam.documentation, "gauge", fam.samples))
        elif typ == "gaugehistogram":
            out.extend(_by_sample_name(fam, "unknown"))
        elif typ == "histogram":
            out.append(_metric(fam.name, fam.documentation, typ,
                               _canonical(fam.samples, "le"), fam.unit))
        elif typ == "summary":
            out.append(_metric(fam.name, fam.documentation, typ,
                               _canonical(fam.samples, "quantile"), fam.unit))
        else:
            out.append(fam)
    return out


class _Families:
    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def render(families: list[Metric], om: bool) -> bytes:
    """Families as text 0.0.4, or as OpenMetrics without ``# EOF`` (the merger writes the
    one at the end) and without ``# TYPE <name> unknown`` lines."""
    if not om:
        return _text_latest(_Families(families))
    body = _om_latest(_Families(families))
    return _UNKNOWN_TYPE_RE.sub(b"", strip_eof(body))


def strip_eof(body: bytes) -> bytes:
    """Drop a trailing ``# EOF`` line (trailing spaces/tabs/CR/LF tolerated); end with ``\\n``."""
    m = _EOF_RE.search(body)
    if m:
        body = body[:m.start()]
    if body and not body.endswith(b"\n"):
        body += b"\n"
    return body


class Claims:
    """The metric names one merged response already uses; first source wins.

    ``om`` selects the rules: OpenMetrics reserves a family's name plus its type's
    suffixes (:data:`OM_SUFFIXES`); text owns its ``# TYPE`` name, the suffixed sample
    names of histograms/summaries, and every sample name. ``dropped`` counts the
    families refused, by source. Names of bodies streamed unparsed (Envoy's, text mode)
    are kept as bytes, so the stream's check is set operations only.
    """

    def __init__(self, om: bool):
        self.om = om
        self.names: set[str] = set()  # reserved by admitted (parsed) families
        self.dropped: dict[str, int] = {}
        self.cut_names: set[bytes] = set()  # streamed families cut (counted once each)
        self._held_b: set[bytes] = set()  # self.names, encoded
        self._streamed: dict[str, set[bytes]] = {}  # metadata names per streamed source
        self._streamed_all: set[bytes] = set()

    def reserved(self, fam: Metric) -> set[str]:
        """The names ``fam`` occupies in this response's format."""
        if self.om:
            return {fam.name} | {fam.name + s for s in OM_SUFFIXES.get(fam.type, ())}
        names = {s.name for s in fam.samples}
        base = fam.name + "_total" if fam.type == "counter" else fam.name
        names.add(base)
        names.update(fam.name + s for s in TEXT_SUFFIXES.get(fam.type, ()))
        return names

    def _held(self, names: set[str]) -> bool:
        """Any of ``names`` used already: by an admitted family, or by a streamed family
        (its own name, or a histogram/summary sample of it: ``x_bucket`` of ``x``)."""
        if names & self.names:
            return True
        for name in names:
            raw = name.encode()
            if raw in self._streamed_all:
                return True
            for suffix in (b"_bucket", b"_sum", b"_count"):
                if raw.endswith(suffix) and raw[:-len(suffix)] in self._streamed_all:
                    return True
        return False

    def _split_shadowing(self, families: list[Metric]) -> list[Metric]:
        """OpenMetrics only: split a structured family whose reserved names (other than
        its own samples') are sample names of another family in this source, or names
        an earlier source holds, into unknown families per sample name."""
        if not self.om:
            return families
        used: dict[str, int] = {}
        for fam in families:
            for name in {s.name for s in fam.samples}:
                used[name] = used.get(name, 0) + 1
        out: list[Metric] = []
        for fam in families:
            if fam.type in ("counter", "histogram", "summary"):
                own = {s.name for s in fam.samples}
                spare = self.reserved(fam) - own
                if any(used.get(n) for n in spare) or self._held(spare):
                    out.extend(_by_sample_name(fam, "unknown"))
                    continue
            out.append(fam)
        return out

    def admit(self, families: list[Metric], source: str) -> list[Metric]:
        """The families of ``source`` that fit, in order; the rest are dropped (counted)."""
        kept = []
        for fam in self._split_shadowing(families):
            names = self.reserved(fam)
            if self._held(names):
                self.dropped[source] = self.dropped.get(source, 0) + 1
                continue
            self.names |= names
            self._held_b.update(n.encode() for n in names)
            kept.append(fam)
        return kept

    def admit_text_names(self, names: set[bytes], source: str) -> set[bytes]:
        """Text mode, for a body streamed unparsed (Envoy's): ``names`` are ``# TYPE`` /
        ``# HELP`` names of one chunk. Returns those another source holds (their
        families must be cut; each counted once); the rest are claimed for ``source``.
        Repeats within ``source`` are not clashes here: a family's HELP and TYPE lines
        may fall into two chunks (the stream itself handles a family declared twice)."""
        mine = self._streamed.setdefault(source, set())
        clash = (names & self._held_b) | ((names & self._streamed_all) - mine)
        if clash:
            fresh = clash - self.cut_names
            if fresh:
                self.dropped[source] = self.dropped.get(source, 0) + len(fresh)
                self.cut_names |= fresh
            names = names - clash
        mine |= names
        self._streamed_all |= names
        return clash
