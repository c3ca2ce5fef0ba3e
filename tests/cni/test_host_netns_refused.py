"""An ADD whose netns is the node's own (the agent's, or pid 1's) is refused, whatever
path names it, before any rule is applied (issue 28).

The real :class:`KernelNetns` opens and compares the namespaces; only its rule methods
are replaced by recorders, so a regression can never put redirection rules in this
machine's own netns."""

from __future__ import annotations

import os
import subprocess

import pytest

from cni.enrollment import EnrollmentError, PodState, Step
from cni.enrollment.api import HostNetnsRefused
from cni.enrollment.kernel import KernelNetns
from tests.cni.test_enrollment_reconciler import Rig, event


class RecordingKernelNetns(KernelNetns):
    """KernelNetns whose rule steps only record that they were asked."""

    def __init__(self) -> None:
        super().__init__()
        self.applied: list[int] = []

    def apply_rules(self, fd, backend, opts, label, known):  # never the kernel here
        self.applied.append(fd)
        return "applied"

    def delete_rules(self, *args, **kwargs):
        self.applied.append(-1)


def _host_paths(tmp_path) -> list[str]:
    link = tmp_path / "netns-link"
    link.symlink_to("/proc/self/ns/net")
    paths = ["/proc/self/ns/net", f"/proc/{os.getpid()}/ns/net",
             f"/proc/{os.getpid()}/task/{os.getpid()}/ns/net", str(link)]
    try:  # pid 1's, where this sandbox lets us open it (another user namespace may not)
        os.close(os.open("/proc/1/ns/net", os.O_RDONLY))
        paths.append("/proc/1/ns/net")
    except OSError:
        pass
    return paths


@pytest.fixture
def bind_mounted_host_netns(tmp_path):
    """The host netns bind-mounted on a file, as ``ip netns`` would name it."""
    if os.geteuid() != 0:
        pytest.skip("needs root: bind-mounts a netns file")
    target = tmp_path / "netns-bind"
    target.touch()
    subprocess.run(["mount", "--bind", "/proc/self/ns/net", str(target)], check=True)
    try:
        yield str(target)
    finally:
        subprocess.run(["umount", str(target)], check=False)


def test_kernel_open_refuses_every_path_to_the_host_netns(tmp_path):
    ops = KernelNetns()
    before = set(os.listdir("/proc/self/fd"))
    for path in _host_paths(tmp_path):
        with pytest.raises(HostNetnsRefused) as e:
            ops.open(path)
        assert path in str(e.value) and "node's own network namespace" in str(e.value)
    assert set(os.listdir("/proc/self/fd")) <= before  # every fd opened was closed


def test_kernel_open_refuses_a_bind_mount_of_it(bind_mounted_host_netns):
    with pytest.raises(HostNetnsRefused):
        KernelNetns().open(bind_mounted_host_netns)


async def test_add_in_the_host_netns_fails_before_any_rule(state_dir, tmp_path):
    rig = Rig(state_dir)
    ops = rig.enrollment.netns = rig.enrollment.dataplane.netns = RecordingKernelNetns()
    try:
        for i, path in enumerate(_host_paths(tmp_path)):
            uid = f"uid-host-{i}"
            with pytest.raises(EnrollmentError) as e:
                await rig.enrollment.enroll(event(uid=uid, netns=path))
            assert not e.value.retryable
            assert f"field 'netns': netns {path} is the node's own network namespace" in str(e.value)
            rec = rig.enrollment.pods()[uid]
            assert rec.status is PodState.FAILED and rec.steps == {Step.NETNS: False}
        assert ops.applied == []  # no rule was applied (nor deleted) anywhere
        assert rig.zds.adds == [] and rig.probes.entries == {}
        assert uid not in rig.enrollment.retries
    finally:
        rig.close()
