"""/proc scan over a fake proc tree whose ``ns/net`` entries are symlinks to real netns
(setting ``proc_dir``); cgroup and stat files are written as the kernel formats them.
Real processes in real pod cgroups need a container runtime; the parsing and the
netns checks here are the real code paths."""

from __future__ import annotations

import os

from cni.podnetns import host_netns_id, scan


def fake_proc(root, pid: int, netns_path: str, uid: str, start: int) -> None:
    d = root / str(pid)
    (d / "ns").mkdir(parents=True)
    os.symlink(netns_path, d / "ns" / "net")
    (d / "cgroup").write_text(f"0::/kubepods/besteffort/pod{uid}/c{pid}\n")
    fields = ["S"] + ["0"] * 18 + [str(start)] + ["0"] * 10
    (d / "stat").write_text(f"{pid} (pause proc) " + " ".join(fields) + "\n")


def test_scan_finds_oldest_and_rejects_wrong_netns(bridge, tmp_path):
    a, b, c = bridge.add_pod("ta"), bridge.add_pod("tb"), bridge.add_pod("tc")
    proc = tmp_path / "proc"
    fake_proc(proc, 100, a.netns_path, a.uid, start=500)
    fake_proc(proc, 101, b.netns_path, a.uid, start=400)  # claims pod A, sits in B's netns
    fake_proc(proc, 102, b.netns_path, b.uid, start=900)
    fake_proc(proc, 103, "/proc/self/ns/net", c.uid, start=1)  # host netns: skipped
    found = scan(str(proc), {a.uid: [a.ip], b.uid: [b.ip], c.uid: [c.ip]}, host_netns_id())
    try:
        assert set(found) == {a.uid, b.uid}
        assert found[a.uid].pid == 100  # the older impostor's netns lacks A's IP
        assert found[b.uid].inode == os.stat(b.netns_path).st_ino
    finally:
        for hit in found.values():
            os.close(hit.fd)


def test_scan_oldest_process_wins(bridge, tmp_path):
    a = bridge.add_pod("ta")
    a2 = bridge.add_pod("tb")
    proc = tmp_path / "proc"
    fake_proc(proc, 200, a.netns_path, a.uid, start=70298968)
    fake_proc(proc, 201, a2.netns_path, a.uid, start=80000000)
    # give A's IP to the second netns too: both qualify, the oldest process wins
    a2.exec("ip", "addr", "add", f"{a.ip}/32", "dev", "lo")
    found = scan(str(proc), {a.uid: [a.ip]}, host_netns_id())
    try:
        assert found[a.uid].starttime == 70298968
        assert found[a.uid].inode == os.stat(a.netns_path).st_ino
    finally:
        for hit in found.values():
            os.close(hit.fd)


def test_netns_addresses_agree_with_netlink(bridge):
    """The cheap address listing (SIOCGIFCONF + ``/proc/thread-self/net/if_inet6``) that
    restart recovery uses per pod gives what a netlink dump of the same netns gives:
    the veth's IPv4 and IPv6 addresses, extra and secondary addresses, one on an
    interface that is down, and the loopback ones."""
    from pyroute2 import IPRoute

    from cni import podnetns

    pod = bridge.add_pod("tn")
    pod.exec("ip", "addr", "add", "10.77.0.1/24", "dev", pod.pod_veth)
    pod.exec("ip", "addr", "add", "10.77.0.2/24", "dev", pod.pod_veth)  # secondary
    pod.exec("ip", "link", "add", "td0", "type", "veth", "peer", "name", "td1")
    pod.exec("ip", "addr", "add", "10.78.0.1/32", "dev", "td0")  # interface down
    pod.exec("ip", "-6", "addr", "add", "fd00:77::1/128", "dev", "lo")

    def both():
        with IPRoute() as ipr:
            dumped = {podnetns._unmap(m.get_attr("IFA_ADDRESS")) for m in ipr.get_addr()}
        return podnetns.netns_addresses(), dumped

    cheap, dumped = pod.run(both)
    assert cheap == dumped
    assert {pod.ip, "10.77.0.1", "10.77.0.2", "10.78.0.1", "fd00:77::1", "127.0.0.1"} <= cheap
    assert podnetns.netns_holds_ip(pod.netns_path, ["10.78.0.1"], own_thread=False)
    assert not podnetns.netns_holds_ip(pod.netns_path, ["10.79.0.1"])
