"""Pure parsing rules of the status server: ISTIO_KUBE_APP_PROBERS (case 25),
ISTIO_PROMETHEUS_ANNOTATIONS (case 32), Accept filtering (case 31),
Envoy admin stats readiness messages (case 30)."""

from __future__ import annotations

import pytest

from agent.core import appprobes, scrapetargets
from agent.status import exposition, familygate
from agent.status import metrics_merge as mm
from agent.status import readiness


# --- ISTIO_KUBE_APP_PROBERS ---------------------------------------------------------------

@pytest.mark.parametrize("value, message", [
    ("{not json", "failed to decode"),
    ('{"abc": {"httpGet": {"port": 80}}}', "invalid path"),
    ('{"/app-health/c/livez": {"exec": {"command": ["x"]}}}', "invalid prober type"),
    ('{"/app-health/c/livez": {"httpGet": {"port": 80}, "tcpSocket": {"port": 80}}}',
     "must be one of type httpGet, tcpSocket or gRPC"),
    ('{"/app-health/c/livez": {"httpGet": {"port": "80"}}}', "must be int type"),
    ('{"/app-health/c/livez": {"tcpSocket": {"port": "http"}}}', "must be int type"),
    ('{"/app-health/c/readyz": {"grpc": {"port": 0}}}', "grpc.port=0"),
    ('{"/app-health/c/livez": {"httpGet": {"port": 80}, "timeoutSeconds": "1"}}',
     "timeoutSeconds"),
    ('[1]', "expected a JSON object"),
])
def test_probers_rejected_with_path_and_field(value, message):
    with pytest.raises(appprobes.ProberConfigError, match=message):
        appprobes.parse_probers(value)


def test_probers_accepted_shapes():
    parsed = appprobes.parse_probers(
        '{"/app-health/hello/livez":{"httpGet":{"port":80}},'
        '"/app-health/hello/readyz":{"httpGet":{"path":"health","port":3333,"scheme":"HTTPS"},'
        '"timeoutSeconds":2},'
        '"/app-lifecycle/hello/poststartz":{"tcpSocket":{"port":93}},'
        '"/app-health/g/startupz":{"gRPC":{"port":50051,"service":null}},'
        '"/app-health/h/livez":{"HttpGet":{"Port":81,"Path":"/x"}}}')
    assert parsed["/app-health/hello/livez"] == appprobes.AppProbe("httpGet", 80, path="/")
    assert parsed["/app-health/hello/readyz"] == appprobes.AppProbe(
        "httpGet", 3333, path="/health", scheme="https", timeout=2.0)
    assert parsed["/app-lifecycle/hello/poststartz"].kind == "tcpSocket"
    assert parsed["/app-health/g/startupz"] == appprobes.AppProbe("grpc", 50051, service="")
    assert parsed["/app-health/h/livez"] == appprobes.AppProbe("httpGet", 81, path="/x")
    assert appprobes.parse_probers("{}") == {}
    assert appprobes.parse_probers(None) == {}


# --- ISTIO_PROMETHEUS_ANNOTATIONS ---------------------------------------------------------

def test_annotations_default_target_and_targets():
    assert scrapetargets.parse_annotations('{"scrape":"true"}', 15020) == [scrapetargets.ScrapeTarget(80, "/metrics")]
    assert scrapetargets.parse_annotations('{"scrape":"false","port":"8080"}', 15020) == []
    assert scrapetargets.parse_annotations(None, 15020) == []
    assert scrapetargets.parse_annotations(
        '{"scrape":"true","path":"/metrics","port":"8080","targets":[{"port":"8080",'
        '"path":"/metrics"},{"port":"9100","path":"/custom"},{"port":9200}]}', 15020) == [
        scrapetargets.ScrapeTarget(8080, "/metrics"), scrapetargets.ScrapeTarget(9100, "/custom"),
        scrapetargets.ScrapeTarget(9200, "/metrics")]


@pytest.mark.parametrize("port", ["15020", "015020", "15000", "015000", "15090", "15006",
                                  "abc", "0", "70000", ""])
def test_annotations_reserved_or_bad_port_rejected(port):
    with pytest.raises(scrapetargets.AnnotationsError, match=r"targets\[0\]\.port"):
        scrapetargets.parse_annotations({"targets": [{"port": port}]}, 15020)


def test_annotations_custom_status_port_and_empty_value():
    with pytest.raises(scrapetargets.AnnotationsError, match="reserved"):
        scrapetargets.parse_annotations('{"port":"16000"}', 16000)
    with pytest.raises(scrapetargets.AnnotationsError, match="empty"):
        scrapetargets.parse_annotations(None, 15020, given=True)
    with pytest.raises(scrapetargets.AnnotationsError, match="failed to decode"):
        scrapetargets.parse_annotations("{", 15020)


# --- Accept filtering ---------------------------------------------------------------------

@pytest.mark.parametrize("header, expected", [
    ("", "text/plain;version=0.0.4"),
    (None, "text/plain;version=0.0.4"),
    ("/", "text/plain;version=0.0.4"),
    ("application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;"
     "encoding=delimited", "text/plain;version=0.0.4"),
    ("*/*", "text/plain;version=0.0.4;q=0.1"),
    ("application/*", "application/openmetrics-text;version=0.0.1;q=0.1"),
    ("application/openmetrics-text;version=1.0.0;q=0.9,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
     "application/openmetrics-text;version=1.0.0;q=0.3,text/plain;version=0.0.4;q=0.2,"
     "text/plain;version=0.0.4;q=0.1"),
])
def test_filter_accept_for_app(header, expected):
    assert mm.filter_accept(header, mm.APP_ACCEPT) == expected


def test_filter_accept_for_envoy_never_openmetrics():
    got = mm.filter_accept("application/openmetrics-text;version=1.0.0,application/*",
                           mm.ENVOY_ACCEPT)
    assert got == "text/plain;version=0.0.4"


def test_body_format_and_strip_eof():
    assert mm.body_format("application/openmetrics-text; version=1.0.0; charset=utf-8") == "om-1.0.0"
    assert mm.body_format("application/openmetrics-text") == "om-0.0.1"
    assert mm.body_format("text/plain; version=0.0.4") == "text"
    assert exposition.strip_eof(b"a 1\n# EOF\n") == b"a 1\n"
    assert exposition.strip_eof(b"a 1\n# EOF \t\r\n\n") == b"a 1\n"
    assert exposition.strip_eof(b"a 1") == b"a 1\n"
    assert exposition.strip_eof(b"# EOF\n") == b""


def test_gate_cuts_whole_families_an_earlier_source_holds():
    from agent.status import exposition as ex
    claims = ex.Claims(om=False)
    agent = ex.parse_text(b"# TYPE a_total counter\na_total 1\n# TYPE h histogram\n"
                          b'h_bucket{le="+Inf"} 1\nh_sum 1\nh_count 1\n')
    assert len(claims.admit(ex.for_text(agent), "agent")) == 2
    g = familygate.FamilyGate(claims, "envoy")
    assert g.filter(b"# HELP a_total A\n# TYPE a_total counter\na_total 1\n# TYPE b gauge\nb 1\n") \
        == b"# TYPE b gauge\nb 1\n"
    assert claims.dropped == {"envoy": 1}
    # a cut family continues into the next chunk; the next block is kept
    assert g.filter(b"# TYPE h_bucket gauge\nh_bucket 1\n") == b""
    assert g.filter(b'h_bucket{x="2"} 2\n# TYPE c gauge\nc 1\n') == b"# TYPE c gauge\nc 1\n"
    # what the stream declared is held for later (parsed) sources, histogram samples too
    app = ex.parse_text(b"# TYPE b gauge\nb 2\n# TYPE c_sum gauge\nc_sum 1\n# TYPE d gauge\nd 1\n")
    assert [f.name for f in claims.admit(ex.for_text(app), "application")] == ["d"]
    assert claims.dropped == {"envoy": 2, "application": 2}


def test_gate_fast_path_passes_chunk_through_and_catches_repeats():
    """The common case (nothing cut) hands back the very same buffer, no copy; a family
    this body declares again, within one chunk or across chunks, keeps its samples,
    only the repeated metadata lines cut."""
    from agent.status.exposition import Claims
    g = familygate.FamilyGate(Claims(om=False), "envoy")
    chunk = b"# TYPE envoy_a counter\nenvoy_a 1\n# HELP envoy_b B\n# TYPE envoy_b gauge\nenvoy_"
    out = g.filter(chunk, len(chunk) - 7)  # up to the last full line, as streamed
    assert isinstance(out, memoryview) and out.obj is chunk and bytes(out) == chunk[:-7]
    same = b"envoy_b 2\n# TYPE envoy_c gauge\nenvoy_c 1\n"
    assert g.filter(same) is same  # the block that began in the previous chunk goes on
    assert g.filter(b"a 1 # TYPE not_metadata x\n# HELPER x\n") == \
        b"a 1 # TYPE not_metadata x\n# HELPER x\n"  # only "# HELP "/"# TYPE " at line start
    assert g.filter(b"# TYPE envoy_a counter\nenvoy_a{y=\"1\"} 2\n# TYPE envoy_d gauge\nenvoy_d 1\n") \
        == b'envoy_a{y="1"} 2\n# TYPE envoy_d gauge\nenvoy_d 1\n'
    assert g.filter(b"# TYPE envoy_e gauge\nenvoy_e 1\n# TYPE envoy_e gauge\nenvoy_e 2\n") == \
        b"# TYPE envoy_e gauge\nenvoy_e 1\nenvoy_e 2\n"
    assert g.filter(b'envoy_e{z="3"} 3\n') == b'envoy_e{z="3"} 3\n'  # its group goes on
    kept = b"# TYPE envoy_f gauge\nenvoy_f 1\n"
    assert g.filter(kept) == kept
    assert g.filter(b"envoy_f 2\n") == b"envoy_f 2\n"  # no metadata at all: not cut
    assert g.claims.dropped == {}


@pytest.mark.parametrize("body", [
    b"# TYPE a counter\na 1\n", b"x# TYPE a b\n# TYPE b c\n#", b"# HELP a\tb\n#\n# TYPE c d",
    b'a{l="#"} 1\n# TYPE z gauge\n', b"## TYPE q r\n# TYPE\n# TYPE r s", b""])
def test_fast_and_slow_metadata_scans_agree(body):
    """The fast path's keys (memchr + one findall) equal the slow path's line walk, also
    for "#" inside labels, a "#" right before a line break and no final newline."""
    assert familygate._metadata_keys(body, len(body)) == \
        [key for _, key in familygate._metadata_lines(body, len(body))]


# --- Envoy admin stats → readiness messages -----------------------------------------------

def test_envoy_config_messages():
    summary = "cds updates: 0 successful, 0 rejected; lds updates: 1 successful, 0 rejected"
    assert readiness.config_error(readiness.parse_stats(
        "listener_manager.lds.update_success: 1\n")) == \
        f"config not fully received from XDS server: {summary}"
    assert readiness.config_error({}).startswith(
        "config not received from XDS server (is Istiod running?): cds updates: 0")
    assert readiness.config_error(readiness.parse_stats(
        "cluster_manager.cds.update_rejected: 1\nlistener_manager.lds.update_success: 1\n")
    ).startswith("config received from XDS server, but was rejected:")
    assert readiness.config_error(readiness.parse_stats(
        "cluster_manager.cds.update_success: 2\nlistener_manager.lds.update_success: 1\n")) is None


def test_envoy_live_messages():
    assert readiness.live_error("server.state: 0\nlistener_manager.workers_started: 0\n") == \
        "workers have not yet started"
    assert readiness.live_error("server.state: 3\nlistener_manager.workers_started: 0\n") == \
        "server is not live, current state is: INITIALIZING"
    assert readiness.live_error("server.state: 0\nlistener_manager.workers_started: 1\n") is None
    assert "missing" in readiness.live_error("")


def test_text_to_openmetrics_keeps_sample_names_and_parses_strictly():
    """Envoy's shape reduced: a counter without _total whose name is the base of another
    counter's, and a histogram with non-canonical le values."""
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as om

    from agent.status import exposition as ex
    body = (b'# TYPE envoy_rq counter\nenvoy_rq{code="200"} 3\n'
            b'# TYPE envoy_rq_total counter\nenvoy_rq_total 3\n'
            b'# TYPE envoy_t histogram\nenvoy_t_bucket{le="1"} 1\nenvoy_t_bucket{le="+Inf"} 2\n'
            b'envoy_t_sum 3\nenvoy_t_count 2\n')
    claims = ex.Claims(om=True)
    out = ex.render(claims.admit(ex.for_openmetrics(ex.parse_text(body)), "envoy"), True)
    fams = {f.name: f for f in om(out.decode() + "# EOF\n")}
    assert [s.name for s in fams["envoy_rq"].samples] == ["envoy_rq"]
    assert [s.name for s in fams["envoy_rq_total"].samples] == ["envoy_rq_total"]
    assert fams["envoy_t"].type == "histogram"
    assert b'le="1.0"' in out and b"# TYPE envoy_rq " not in out and claims.dropped == {}


def test_envoy_family_in_two_groups_keeps_every_sample():
    """Envoy may emit one family in two separate groups (its ``# TYPE`` name twice, not
    adjacent, in one scrape): both groups' samples survive, under one family. OpenMetrics
    (parsed): merged into the first group's place; text (streamed): the repeated
    HELP/TYPE lines cut, the samples kept; nothing counted as dropped."""
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as om
    from prometheus_client.parser import text_string_to_metric_families as text

    from agent.status import exposition as ex
    from agent.status.metrics_merge import _envoy_openmetrics

    body = (b'# HELP envoy_rq requests\n# TYPE envoy_rq gauge\nenvoy_rq{code="200"} 3\n'
            b'# TYPE envoy_other gauge\nenvoy_other 1\n'
            b'# HELP envoy_rq requests\n# TYPE envoy_rq gauge\nenvoy_rq{code="503"} 2\n')
    claims = ex.Claims(om=True)
    out = _envoy_openmetrics(body, claims)
    fams = list(om(out.decode() + "# EOF\n"))
    assert [f.name for f in fams] == ["envoy_rq", "envoy_other"] and claims.dropped == {}
    assert [(s.labels["code"], s.value) for s in fams[0].samples] == [("200", 3), ("503", 2)]

    claims = ex.Claims(om=False)
    gated = bytes(familygate.FamilyGate(claims, "envoy").filter(body))
    assert gated.count(b"# TYPE envoy_rq ") == 1 and claims.dropped == {}
    samples = [(s.name, s.labels, s.value) for f in text(gated.decode()) for s in f.samples]
    assert ("envoy_rq", {"code": "200"}, 3) in samples
    assert ("envoy_rq", {"code": "503"}, 2) in samples and len(samples) == 3


def test_line_aligned_stream_gives_the_same_body_for_any_chunking():
    """The Envoy stream (:class:`familygate.LineAligned`) copies only the line that
    straddles two chunks; whatever the chunk boundaries, the gated body is the one the
    gate gives for the whole body at once (a held family cut, a family declared twice
    kept with its second TYPE line cut, the rest kept byte for byte, a missing final
    newline added)."""
    import random

    from agent.status import exposition as ex

    body = (b"# TYPE keep_a counter\nkeep_a 1\n# TYPE held gauge\nheld 1\nheld{x=\"y\"} 2\n"
            b"# HELP keep_b B\n# TYPE keep_b gauge\nkeep_b 3\n# TYPE keep_a counter\nkeep_a 9\n"
            b"# TYPE keep_c gauge\nkeep_c 4")

    def gated(chunks):
        claims = ex.Claims(om=False)
        claims.admit(ex.for_text(ex.parse_text(b"# TYPE held gauge\nheld 0\n")), "agent")
        stream = familygate.LineAligned(familygate.FamilyGate(claims, "envoy"))
        out = b"".join(bytes(p) for c in chunks for p in stream.feed(c))
        return out + b"".join(bytes(p) for p in stream.close())

    want = gated([body])
    assert want == (b"# TYPE keep_a counter\nkeep_a 1\n# HELP keep_b B\n# TYPE keep_b gauge\n"
                    b"keep_b 3\nkeep_a 9\n# TYPE keep_c gauge\nkeep_c 4\n")
    rnd = random.Random(7)
    for _ in range(300):
        cuts = sorted(rnd.sample(range(1, len(body)), rnd.randint(1, 12)))
        chunks = [body[a:b] for a, b in zip([0] + cuts, cuts + [len(body)])]
        assert gated(chunks) == want, chunks


async def test_envoy_admin_answering_garbage_is_not_called_unreachable():
    """A real HTTP server standing in for an Envoy admin that answers non-UTF-8 bytes:
    the reason said "not reachable: 'utf-8' codec can't decode"; it answered."""
    import aiohttp
    from aiohttp import web

    from tests.status.conftest import serve_app

    async def garbage(request):
        return web.Response(body=b"\xff\xfe\x00garbage", content_type="text/plain",
                            charset="utf-8")

    async def unavailable(request):
        return web.Response(status=503)
    for handler, want in ((garbage, "answered something that is not Envoy's stats"),
                          (unavailable, "answered HTTP status code 503")):
        app = web.Application()
        app.router.add_get("/stats", handler)
        async with serve_app(app) as port:
            check = readiness.EnvoyReadiness(f"http://127.0.0.1:{port}", lambda: "")
            async with aiohttp.ClientSession() as session:
                reason = await check.check(session)
        assert reason is not None and want in reason and "not reachable" not in reason, reason
