"""agent.demo.cni_runtime (our small libcni) on plugin executables that misbehave.

The hung plugin is a two-line shell script: no real CNI plugin hangs on demand."""

from __future__ import annotations

import os

import pytest

from agent.demo.cni_runtime import CniPluginError, CniRuntime


def test_hung_plugin_is_a_plugin_error_naming_the_timeout(tmp_path):
    plugin = tmp_path / "hangs"
    plugin.write_text("#!/bin/sh\necho starting >&2\nexec sleep 30\n")
    os.chmod(plugin, 0o755)
    runtime = CniRuntime([str(tmp_path)], str(tmp_path / "cache"), timeout=0.3)
    with pytest.raises(CniPluginError, match=r"hangs failed .*ADD did not finish within 0.3s"):
        runtime.exec_plugin("ADD", {"type": "hangs", "cniVersion": "1.0.0", "name": "n"},
                            "c1", "/proc/self/ns/net", "eth0")


def test_missing_plugin_names_the_search_path(tmp_path):
    runtime = CniRuntime([str(tmp_path)], str(tmp_path / "cache"))
    with pytest.raises(CniPluginError, match="not found in " + str(tmp_path)):
        runtime.exec_plugin("ADD", {"type": "nope"}, "c1", "/n", "eth0")
