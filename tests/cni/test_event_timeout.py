"""The plugin tells the agent how long it waits (event field ``timeout`` = its
``agent_timeout``), so the agent can answer an ADD with the real cause before the plugin
gives up (issue 17 item 10). The real plugin through our launcher, the real event server."""

from __future__ import annotations

import pytest

from cni.events import CniPodEvent, EventError
from tests.cni.conftest import cni_env, net_conf, run_plugin


@pytest.mark.parametrize("conf_timeout,expected", [(None, 5.0), (2.5, 2.5), (7, 7)])
async def test_plugin_sends_its_agent_timeout(cni_agent, launcher, conf_timeout, expected):
    keys = {"ambient_default": True}
    if conf_timeout is not None:
        keys["agent_timeout"] = conf_timeout
    rc, out, err = await run_plugin(launcher, cni_env(), net_conf(cni_agent.run_dir, **keys))
    assert rc == 0, (out, err)
    assert [e.timeout for e in cni_agent.enroller.enrolled] == [expected]


@pytest.mark.parametrize("bad", [0, -1, True, "5", float("inf"), [5]])
def test_event_timeout_must_be_positive_seconds(bad):
    with pytest.raises(EventError, match=r"field 'timeout' must be a positive number"):
        CniPodEvent.from_json({"command": "ADD", "container_id": "c", "netns": "/n",
                               "timeout": bad})


def test_event_without_timeout_is_accepted():
    ev = CniPodEvent.from_json({"command": "ADD", "container_id": "c", "netns": "/n"})
    assert ev.timeout is None
