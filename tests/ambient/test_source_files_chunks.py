"""The directory source's chunked YAML parse: a multi-document file is cut on its
column-0 ``---`` lines, and a reload parses only the chunks whose text changed (issue 28:
one pod changed in a 5,000-pod file). Every result is checked against a whole-file parse
of the same text by the same bounded loader, and against PyYAML's own ``load_all``; the
directory tests use a real tmp directory watched with inotify (watchfiles)."""

from __future__ import annotations

import asyncio
import textwrap

import pytest
import yaml

from ambient.source_files import DirectorySource, _ChunkStats, _docs, parse_file, split_chunks
from ambient.store import ObjectStore
from tests.ambient.test_yaml_bombs import bomb
from tests.helpers import eventually


async def run_blocking(fn, *args):
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def pod(i: int, app: str = "web") -> str:
    return textwrap.dedent(f"""\
        apiVersion: v1
        kind: Pod
        metadata:
          name: p{i}
          namespace: demo
          uid: u-{i}
          labels: {{app: {app}}}
        spec: {{nodeName: n1, serviceAccountName: sa}}
        status: {{podIP: 10.0.{i // 250}.{i % 250 + 1}, phase: Running}}
        """)


def pods_file(n: int, changed: int = -1) -> str:
    return "---\n".join(pod(i, "api" if i == changed else "web") for i in range(n))


def chunked(text: str, cache: dict | None = None) -> tuple[list, str, dict, _ChunkStats]:
    fresh: dict = {}
    stats = _ChunkStats()
    docs, error = _docs("f.yaml", text, cache, fresh, stats)
    return docs, error, fresh, stats


def test_one_pod_changed_reparses_only_its_chunk(tmp_path):
    f = tmp_path / "pods.yaml"
    f.write_text(pods_file(50))
    first = parse_file(str(f))
    assert (first.chunks_parsed, first.chunks_reused, len(first.chunks)) == (50, 0, 50)
    f.write_text(pods_file(50, changed=17))
    second = parse_file(str(f), first.chunks)
    assert (second.chunks_parsed, second.chunks_reused) == (1, 49)
    assert not second.broken
    # the result is what a parse without the cache gives
    assert [o for o, _ in second.objects] == [o for o, _ in parse_file(str(f)).objects]
    assert second.objects[17][0]["metadata"]["labels"] == {"app": "api"}
    # unchanged documents are the cached objects themselves, not re-built copies
    assert all(second.objects[i][0] is first.objects[i][0] for i in range(50) if i != 17)
    assert second.objects[17][0] is not first.objects[17][0]
    # the cache holds exactly the chunks of the current text: the old pod17 chunk is gone
    assert set(second.chunks) == set(split_chunks(pods_file(50, changed=17)))
    assert len(second.chunks) == 50


def test_error_in_a_later_document_names_its_line_in_the_file(tmp_path):
    good = pods_file(6)
    f = tmp_path / "pods.yaml"
    f.write_text(good)
    cache = parse_file(str(f)).chunks
    # document #4 gets an unclosed flow mapping on its 'spec' line
    docs = good.split("---\n")
    docs[4] = docs[4].replace("spec: {nodeName: n1,", "spec: {nodeName: [n1,")
    bad = "---\n".join(docs)
    f.write_text(bad)
    lines = bad.splitlines()
    spec_line = next(n for n, line in enumerate(lines, 1) if "[n1," in line)
    # libyaml on the whole text: where the error is
    with pytest.raises(yaml.MarkedYAMLError) as e:
        list(yaml.load_all(bad, Loader=yaml.CSafeLoader))
    line = e.value.problem_mark.line + 1
    markers = [n for n, text in enumerate(lines, 1) if text == "---"]
    assert markers[3] < line <= spec_line + 1 < markers[4]  # inside document #4, far down
    for parsed in (parse_file(str(f), cache), parse_file(str(f))):
        assert parsed.broken_kind == "syntax"
        assert f"malformed YAML at line {line}:" in parsed.broken, parsed.broken
        assert [o["metadata"]["name"] for o, _ in parsed.objects] == ["p0", "p1", "p2", "p3"]
        assert parsed.chunks == {}  # parsed whole: nothing cached from a broken text


def test_alias_bomb_in_a_changed_chunk_is_still_refused(tmp_path):
    f = tmp_path / "pods.yaml"
    f.write_text(pods_file(4))
    cache = parse_file(str(f)).chunks
    docs = pods_file(4).split("---\n")
    docs[3] = docs[3].replace("labels: {app: web}", "labels: " + bomb(7))
    f.write_text("---\n".join(docs))
    parsed = parse_file(str(f), cache)
    assert parsed.broken_kind == "syntax" and "alias bomb" in parsed.broken
    assert len(parsed.broken) < 300
    # the error names the bad document's start in the file: the line after its '---'
    marker = [n for n, text in enumerate("---\n".join(docs).splitlines(), 1) if text == "---"][2]
    assert f"at line {marker + 1}:" in parsed.broken, parsed.broken
    assert [o["metadata"]["name"] for o, _ in parsed.objects] == ["p0", "p1", "p2"]


TEXTS = {
    "block scalar ended by a column-0 marker": "a: |\n  x\n---\n  y\n",
    "top-level block scalar then a mapping": "--- |\n  x\n---\ny: 1\n",
    "indented --- inside a block scalar": "a: |\n  x\n  ---\n  y\n---\nb: 2\n",
    "block scalar content at column 0 (an error)": "--- |\nx\n---\n",
    "--- inside a quoted scalar (an error)": "a: 'q\n---\n'\n",
    "--- inside a flow sequence (an error)": "a: [1,\n---\n]\n",
    "%YAML directive": "%YAML 1.1\n---\na: 1\n---\nb: 2\n",
    "%TAG directive": "%TAG !e! tag:example.com,2000:\n---\na: 1\n---\nb: 2\n",
    "document end markers": "a: 1\n...\n---\nb: 2\n...\n",
    "empty documents": "a: 1\n---\n---\n",
    "comments before the first marker": "# c\n\n---\na: 1\n--- # note\nb: 2\n",
    "content on the marker line": "--- {a: 1}\n--- [1, 2]\n---\nc: 3\n",
    "CRLF line ends": "a: 1\r\n---\r\nb: 2\r\n---\r\n",
    "---x is not a marker": "a: |\n  x\n---x: 1\n",
    "bare document after ... (an error)": "a: 1\n...\nb: 2\n",
    "kind List": "kind: List\nitems:\n- {kind: Pod}\n- {kind: Service}\n---\na: 1\n",
    "anchors are per document": "a: &x 1\nb: *x\n---\nc: &x 2\nd: *x\n",
    "alias to an anchor of an earlier document (an error)": "a: &x 1\n---\nb: *x\n",
}


@pytest.mark.parametrize("name", list(TEXTS))
def test_chunked_parse_matches_a_whole_parse_and_pyyaml(name):
    text = TEXTS[name]
    whole = _docs("f.yaml", text)
    cold = chunked(text)
    warm = chunked(text, cold[2])
    assert cold[:2] == whole and warm[:2] == whole
    try:
        expected: object = list(yaml.load_all(text, Loader=yaml.CSafeLoader))
    except yaml.YAMLError:
        expected = None
    if expected is None:
        assert whole[1].startswith("malformed YAML")
        assert cold[2] == {}  # an error is always reported from the whole parse
    else:
        assert whole == (expected, "")
    if text.startswith("%") or expected is None:
        assert cold[3].parsed == 0  # parsed whole, not in chunks
    else:
        assert cold[3].parsed == len(split_chunks(text)) and warm[3].reused == cold[3].parsed
        assert warm[3].parsed == 0


def test_kind_list_is_one_chunk_parsed_whole():
    text = "apiVersion: v1\nkind: List\nitems:\n" + "".join(
        f"- {{kind: Pod, metadata: {{name: p{i}}}}}\n" for i in range(20))
    assert split_chunks(text) == [text]
    changed = text.replace("name: p3}", "name: q3}")
    docs, error, _, stats = chunked(changed, chunked(text)[2])
    assert not error and stats.parsed == 1 and stats.reused == 0
    assert docs[0]["items"][3]["metadata"]["name"] == "q3"


def test_split_chunks_keeps_the_text_and_refuses_directives():
    text = pods_file(5)
    chunks = split_chunks(text)
    assert chunks is not None and "".join(chunks) == text and len(chunks) == 5
    assert all(c.startswith("---") for c in chunks[1:])
    assert split_chunks("%YAML 1.1\n---\na: 1\n") is None
    assert split_chunks("a: 1\n---\n\ufeffb: 2\n") is None


@pytest.mark.asyncio
async def test_directory_source_reparses_only_the_changed_pod(tmp_path):
    """Through the real source: a rewrite of a 200-pod file with one pod changed parses
    one chunk and the store emits one event (the changed pod's)."""
    store = ObjectStore()
    events: list = []
    store.subscribe(lambda evs: events.extend(evs))
    f = tmp_path / "pods.yaml"
    f.write_text(pods_file(200))
    src = DirectorySource(store, str(tmp_path), run_blocking, debounce_ms=10)
    await src.start()
    try:
        assert len(store) == 200 and src.chunks_parsed == 200
        events.clear()
        staged = tmp_path / ".pods.yaml.tmp"
        staged.write_text(pods_file(200, changed=123))
        staged.replace(f)
        await eventually(lambda: src.chunks_reused >= 199, timeout=20)
        assert src.chunks_parsed == 201
        await eventually(lambda: len(events) == 1, timeout=5)
        assert events[0].name == "p123" and events[0].old is not None
        assert events[0].new is not None and events[0].new["metadata"]["labels"] == {"app": "api"}
        f.unlink()
        await eventually(lambda: len(store) == 0, timeout=20)
        assert str(f) not in src._chunks  # a deleted file's cache is dropped
    finally:
        await src.stop()
