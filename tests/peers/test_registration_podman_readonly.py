"""Issue 27: the systemd unit's ``ProtectSystem=strict`` made podman's database read-only
for the agent; ``podman events`` then fails and every container was registered as
``default/default`` without labels (an ambient container started unmeshed).

Real podman, run by the agent's label source through a wrapper that gives it the mount
view the unit gave it before the fix (its storage and run-time directories read-only,
``unshare -m``): the label source reports podman's own reason, and an ADD whose labels
are unknown is refused naming it (fail closed) instead of registered with defaults. The
same podman with the directories writable (what the unit's ``ReadWritePaths`` now
grants, checked in tests/ops/test_docs_as_written.py) is not broken."""

from __future__ import annotations

import asyncio
import os
import shutil

import pytest

from agent.core.config import load
from agent.core.lifecycle import AgentContext
from cni.events import CniPodEvent
from cni.registration import LocalBackend, WorkloadRegistrar
from cni.registration_record import RegistrationError
from cni.runtime_labels import PodmanLabels
from ambient import source as ambient_source

pytestmark = [pytest.mark.podman,
              pytest.mark.skipif(shutil.which("podman") is None, reason="podman not installed"),
              pytest.mark.skipif(shutil.which("unshare") is None, reason="unshare missing"),
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mount namespace)")]

READ_ONLY = ("/var/lib/containers", "/run/containers", "/run/libpod")


def readonly_podman(tmp_path) -> str:
    """A ``podman`` that sees READ_ONLY (those that exist) read-only, as under the old unit."""
    binds = " ".join(f"mount --bind {d} {d} && mount -o remount,bind,ro {d} {d} &&"
                     for d in READ_ONLY if os.path.isdir(d))
    wrapper = tmp_path / "podman-ro"
    wrapper.write_text("#!/bin/sh\nexec unshare -m --propagation private sh -c "
                       f"'{binds} exec podman \"$@\"' podman \"$@\"\n")
    wrapper.chmod(0o755)
    return str(wrapper)


async def registrar_with(tmp_path, labels: PodmanLabels):
    config = load({"state_dir": str(tmp_path / "state"), "config_file": os.devnull},
                  env={}).replace(workload_registration="local", node_name="host-ro")
    ctx = AgentContext(config)
    source = ambient_source.build(ctx)
    await source.start()
    registrar = WorkloadRegistrar(ctx, LocalBackend(source.store), labels)
    await registrar.start()
    return ctx, source, registrar


async def test_readonly_podman_refuses_unlabelled_add(tmp_path):
    if not os.path.isdir("/var/lib/containers"):
        pytest.skip("podman has no storage on this host yet")
    labels = PodmanLabels(None, command=readonly_podman(tmp_path))
    ctx, source, registrar = await registrar_with(tmp_path, labels)
    try:
        for _ in range(100):
            if labels.broken:
                break
            await asyncio.sleep(0.1)
        assert "read-only file system" in labels.broken, labels.debug_state()
        event = CniPodEvent(command="ADD", container_id="ab" * 32, netns="", pod_name="web",
                            ips=["10.87.10.5"], ambient_default=False)
        with pytest.raises(RegistrationError, match="cannot be read from the runtime") as e:
            await registrar.prepare(event)
        assert "read-only file system" in str(e.value)
        assert registrar.registrations == {} and registrar.stats["failed"] == 1
    finally:
        await registrar.stop(0.5)
        await source.stop(0.5)
        ctx.executor.shutdown(wait=False)


async def test_writable_podman_is_not_broken(tmp_path):
    labels = PodmanLabels(None)
    ctx, source, registrar = await registrar_with(tmp_path, labels)
    try:
        await asyncio.wait_for(labels.started.wait(), 10)
        await asyncio.sleep(1.0)
        assert labels.broken == "", labels.debug_state()
    finally:
        await registrar.stop(0.5)
        await source.stop(0.5)
        ctx.executor.shutdown(wait=False)
