"""What the Kubernetes source's path to its first LIST imports (issue 28: the agent's
cold start is its interpreter and imports before anything else). Each check runs in a
fresh ``-S`` interpreter, as the image runs the agent."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _loaded_after(code: str, modules: list[str]) -> dict[str, bool]:
    prefix = f"import sys; sys.path[1:1] = [{str(ROOT)!r}, {sysconfig.get_paths()['purelib']!r}]; "
    probe = f"; print(','.join(str(m in sys.modules) for m in {modules!r}))"
    out = subprocess.run([sys.executable, "-S", "-c", prefix + code + probe],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return dict(zip(modules, (v == "True" for v in out.strip().split(","))))


def test_kubernetes_source_path_leaves_the_files_source_and_zds_server_unimported():
    """``ambient.source`` (the first component built, before the LISTs go out) no longer
    imports the files source (watchfiles, localconfig's protobuf), and the daemon's
    "is a ZDS server already answering" check no longer imports ``zds.server``: both
    load later, on the worker thread beside the LISTs. The files source itself still
    builds (its module is imported by ``ambient.source.build``). Nor is urllib3's body
    run (``kubelazy`` defers it: kubernetes_asyncio imports it for one unused helper)."""
    loaded = _loaded_after(
        "from agent.core import kubelazy; kubelazy.install(); import ambient.source; "
        "from zds.served import refuse_if_served",
        ["ambient.source_files", "watchfiles", "ambient.localconfig", "zds.server",
         "ambient.source_kube", "urllib3.util"])
    assert loaded == {"ambient.source_files": False, "watchfiles": False,
                      "ambient.localconfig": False, "zds.server": False,
                      "ambient.source_kube": True, "urllib3.util": False}, loaded


def test_refuse_if_served_is_still_what_zds_server_uses():
    from zds import served, server
    assert server.refuse_if_served is served.refuse_if_served
