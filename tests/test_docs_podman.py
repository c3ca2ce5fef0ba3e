"""docs/podman.md's ``containers.conf`` works where the demo's does: the settings the
demo writes for rootful podman (runc, CNI backend, ulimits; without the ulimits runc
fails ``error setting rlimit type 7`` on hosts with low hard limits) are in the doc."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from agent.demo.podman import write_containers_conf

ROOT = Path(__file__).resolve().parent.parent


def test_podman_doc_containers_conf_has_the_demos_runtime_settings(tmp_path):
    doc = (ROOT / "docs" / "podman.md").read_text()
    block = re.search(r"cat > /etc/containers/containers.conf <<'EOF'\n(.*?)\n\s*EOF\n", doc,
                      re.S)
    assert block, "no containers.conf heredoc in docs/podman.md"
    documented = tomllib.loads("\n".join(line.strip() for line in block.group(1).splitlines()))
    write_containers_conf(tmp_path / "c.conf", ["/opt/cni/bin"], tmp_path)
    demo = tomllib.loads((tmp_path / "c.conf").read_text())
    assert documented["containers"]["default_ulimits"] == demo["containers"]["default_ulimits"]
    assert documented["engine"]["runtime"] == demo["engine"]["runtime"]
    assert documented["network"]["network_backend"] == demo["network"]["network_backend"]
