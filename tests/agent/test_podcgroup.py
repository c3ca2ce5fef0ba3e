"""cgroup parsing shared by the restart /proc scan and SDS attestation (``agent.core.podcgroup``)."""

import pytest

from agent.core.podcgroup import CgroupError, canonical_uid, parse_cgroup


def test_kubepods_path_gives_uid_and_container():
    text = "12:pids:/kubepods/pod2c48913c_b29f_11e7_9350_020968147796/" + "a" * 64 + "\n"
    assert parse_cgroup(text) == ("2c48913c-b29f-11e7-9350-020968147796", "a" * 64)


def test_systemd_scope_suffix_trimmed():
    text = ("0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod2c48913c_b29f_"
            "11e7_9350_020968147796.slice/cri-containerd-abc123.scope")
    assert parse_cgroup(text) == ("2c48913c-b29f-11e7-9350-020968147796", "abc123")


def test_crio_without_pod_uid():
    assert parse_cgroup("0::/machine.slice/crio-deadbeef") == ("", "deadbeef")


def test_two_container_ids_is_an_error():
    text = ("1:cpu:/kubepods/pod2c48913c-b29f-11e7-9350-020968147796/a\n"
            "2:memory:/kubepods/pod2c48913c-b29f-11e7-9350-020968147796/b\n")
    with pytest.raises(CgroupError, match=r"multiple container IDs found in cgroups \(a, b\)"):
        parse_cgroup(text)


def test_malformed_line():
    with pytest.raises(CgroupError, match="fewer than 3 fields"):
        parse_cgroup("garbage")


def test_not_a_pod():
    assert parse_cgroup("0::/user.slice/session-1.scope\n") == ("", "")


def test_canonical_uid():
    assert canonical_uid("2C48913C_b29f-11e7") == canonical_uid("2c48913cb29f11e7")


def test_podman_container_cgroups():
    """podman names its container's cgroup by the container ID (cgroupfs and systemd
    managers; the systemd one may have a ``container`` child); conmon's is not it. The
    cgroupfs text is what a podman container on this project's machines shows."""
    cid = "94291f254cad996ca0f7a481bf5128b7eb5e3d49037c0a25b6abf090f9c98fb2"
    cgroupfs = "".join(f"{i}:{c}:/libpod_parent/libpod-{cid}\n" for i, c in
                       enumerate(["", "cpu", "cpuacct", "pids", "name=systemd"]))
    assert parse_cgroup(cgroupfs) == ("", cid)
    assert parse_cgroup(f"0::/machine.slice/libpod-{cid}.scope/container\n") == ("", cid)
    assert parse_cgroup(f"0::/machine.slice/libpod-{cid}.scope\n") == ("", cid)
    assert parse_cgroup(f"0::/machine.slice/libpod-conmon-{cid}.scope\n") == ("", "")
