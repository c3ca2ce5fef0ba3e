"""YAML alias bombs and oversized values, through every YAML the agent reads: the
directory source (a pod's ``metadata.labels`` holding nine levels of nine aliases), the
agent's config file and the tokens file. Each is refused in one short line naming the
file, nothing is expanded, nothing else in the file or the directory is lost, and every
log line stays short. Real files, real loaders, the real store."""

from __future__ import annotations

import logging
import resource
import textwrap

import pytest
import yaml

from agent.core import yamlsafe
from agent.core.config import ConfigError, load as load_config
from ambient.source_files import parse_file
from ambient.store import ObjectStore

LONGEST_LINE = 2000  # characters any log line may have here


def bomb(levels: int, fan: int = 9) -> str:
    """``a0: &a0 [lol]``, then each ``aN`` a list of ``fan`` aliases of ``a(N-1)``:
    ``fan ** levels`` references in about 400 bytes (9 levels of 9)."""
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for n in range(1, levels):
        refs = ",".join(f"*a{n - 1}" for _ in range(fan))
        lines.append(f"a{n}: &a{n} [{refs}]")
    return "{" + ", ".join(lines) + "}"


def pod_with_labels(labels: str, name: str = "bomb") -> str:
    return textwrap.dedent(f"""\
        apiVersion: v1
        kind: Pod
        metadata:
          name: {name}
          namespace: demo
          uid: u-{name}
          labels: LABELS
        spec: {{nodeName: n1}}
        status: {{podIP: 10.0.0.9, phase: Running}}
        """).replace("LABELS", labels)


GOOD_POD = pod_with_labels("{app: web}", name="good")


def _longest(caplog) -> int:
    return max((len(r.getMessage()) for r in caplog.records), default=0)


@pytest.mark.parametrize("levels", [6, 7])
def test_an_alias_bomb_in_pod_labels_is_refused_in_one_short_line(tmp_path, caplog, levels):
    """9**6 once logged one 34 MB line (the rejection wrote out the expanded value); 9**7
    got the agent killed for memory. Now the document is refused before it is built and
    the good pod in the same file still loads."""
    caplog.set_level(logging.INFO)
    f = tmp_path / "pods.yaml"
    f.write_text(GOOD_POD + "---\n" + pod_with_labels(bomb(levels)))
    assert len(f.read_bytes()) < 1000
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    parsed = parse_file(str(f))
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert [o["metadata"]["name"] for o, _ in parsed.objects] == ["good"]
    assert parsed.broken_kind == "syntax"
    assert "alias bomb" in parsed.broken and "at line" in parsed.broken
    assert len(parsed.broken) < 300
    assert grown_kib < 50_000  # a 9**7 expansion is gigabytes
    store = ObjectStore()
    store.replace_origin(str(f), parsed.objects)
    assert store.get("Pod", "demo", "good") is not None


def test_an_alias_bomb_in_the_directory_source_is_one_warning_naming_the_file(
        tmp_path, caplog):
    import asyncio

    from ambient.source_files import DirectorySource

    async def run_blocking(fn, *args):
        return fn(*args)

    caplog.set_level(logging.INFO)
    (tmp_path / "a.yaml").write_text(GOOD_POD)
    bad = tmp_path / "b.yaml"
    bad.write_text(pod_with_labels(bomb(7)))
    store = ObjectStore()
    source = DirectorySource(store, str(tmp_path), run_blocking)
    asyncio.run(_load(source))
    assert store.get("Pod", "demo", "good") is not None
    assert store.get("Pod", "demo", "bomb") is None
    [line] = [r.getMessage() for r in caplog.records if "alias bomb" in r.getMessage()]
    assert str(bad) in line and len(line) < 500
    assert _longest(caplog) < LONGEST_LINE


async def _load(source) -> None:
    try:
        await source.start()
    finally:
        await source.stop()


def test_huge_non_alias_values_are_logged_short(tmp_path, caplog):
    """No alias at all, just a big wrong value: the rejection names the field and shows a
    bounded part of the value."""
    caplog.set_level(logging.INFO)
    f = tmp_path / "pods.yaml"
    big = "{" + ", ".join(f"k{i}: [{', '.join(['v'] * 50)}]" for i in range(2000)) + "}"
    name = "n" * 100_000
    f.write_text(pod_with_labels(big) + "---\n" + pod_with_labels("{}", name=f"[{name}]"))
    parsed = parse_file(str(f))
    store = ObjectStore()
    store.replace_origin(str(f), parsed.objects)
    lines = [r.getMessage() for r in caplog.records if "skipping object" in r.getMessage()]
    assert len(lines) == 2
    assert "metadata.labels" in lines[0] and "metadata.name" in lines[1]
    assert _longest(caplog) < LONGEST_LINE


def test_aliases_in_ordinary_use_still_load():
    """Anchors and merge keys the way people write them (a few shared blocks) are fine."""
    text = textwrap.dedent("""\
        base: &base {nodeName: n1, serviceAccountName: sa}
        pods:
        - {spec: {<<: *base, hostname: a}}
        - {spec: {<<: *base, hostname: b}}
        hosts: ["*.example.com"]
        """)
    data = yamlsafe.load(text)
    assert data["pods"][1]["spec"] == {"nodeName": "n1", "serviceAccountName": "sa",
                                       "hostname": "b"}


def test_a_recursive_document_is_refused():
    with pytest.raises(yamlsafe.AliasBombError, match="recursive"):
        yamlsafe.load("a: &a [1, *a]")


def test_expansion_is_counted_not_built():
    node = yaml.compose(bomb(5), Loader=yaml.SafeLoader)
    expanded, distinct = yamlsafe.expanded_nodes(node, limit=10 ** 9)
    assert distinct < 100 and expanded > 9 ** 4
    with pytest.raises(yamlsafe.AliasBombError, match="alias bomb"):
        yamlsafe.expanded_nodes(node, limit=1000)


def test_the_config_file_and_the_tokens_file_refuse_a_bomb(tmp_path):
    from agent.tlsport.authn import TokensFile

    cfg = tmp_path / "agent.yaml"
    cfg.write_text(f"log_level: info\nextra: {bomb(8)}\n")
    with pytest.raises(ConfigError) as e:
        load_config({}, {"AMBIENT_AGENT_CONFIG_FILE": str(cfg)})
    assert str(cfg) in str(e.value) and "alias bomb" in str(e.value)
    assert len(str(e.value)) < 500
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(f"t1: {bomb(8)}\n")
    tokens.chmod(0o600)
    tf = TokensFile(str(tokens), "cluster.local")
    assert tf.lookup("t1") is None  # refused, accepting nobody
    assert "alias bomb" in tf.error and len(tf.error) < 300


def test_a_yaml_text_past_the_size_bound_is_refused(monkeypatch, tmp_path):
    monkeypatch.setattr(yamlsafe, "MAX_BYTES", 1000)
    f = tmp_path / "big.yaml"
    f.write_text(GOOD_POD * 10)
    parsed = parse_file(str(f))
    assert parsed.objects == [] and "too large" in parsed.broken and "1000" in parsed.broken
    with pytest.raises(yamlsafe.TooLargeError):
        yamlsafe.load(GOOD_POD * 10)
