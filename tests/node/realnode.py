"""A real Kubernetes node on this host, for the tests: containerd + runc + a kubelet,
kube-controller-manager and kube-scheduler, against a kube-apiserver of the test's own.

What runs where, and why:

- kube-apiserver + etcd: scripts/kube-test-apiserver.sh in a fresh directory (not the
  session's server of tests/kube/: a controller manager would act on every other test's
  objects there). kube-controller-manager and kube-scheduler (binaries from
  scripts/kube-test-node.sh, the same k8s.io/kubernetes version) talk to it on loopback.
- the node's network: a netns of its own (``kn<hex>``): containerd and the kubelet run in
  it, so ``hostNetwork`` pods (the agent) get it as their "host" network, and the bridge,
  the pods' routes, the agent's host probe SNAT rules and ipsets, and the ports the agent
  and the kubelet serve all stay out of the real host, which other tests share. It holds
  the node IP (on a veth link) and the service VIP 10.96.0.1 on its loopback; in it, the
  test forwards 127.0.0.1:<apiserver port> (the kubelet's kubeconfig) and 10.96.0.1:443 (the
  ``kubernetes`` Service, which in-cluster clients like the agent dial, as kube-proxy would
  route it) to the API server on the host's loopback (:class:`Forwarder`).
- the node's mounts: containerd, its shims and the kubelet share a mount namespace of
  their own (a holder process keeps it), so every mount they make (overlay rootfs, volume
  tmpfs, the kubelet's rshared root dir) disappears with them; the pods' netns files under
  /var/run/netns (a shared mount) still show on the host, where the agent's HostToContainer
  mount and the test read them. In it, three kernel settings the kubelet would otherwise
  set host-wide at start (vm.overcommit_memory, kernel.panic, kernel.panic_on_oops; it
  writes them when they differ from what it wants, cmd/kubelet's setupKernelTunables) are
  files holding the kubelet's values: the host's stay untouched. And the node has dirs
  of its own at :data:`NODE_DIRS` (the DaemonSet's socket hostPaths, which must be the
  same path in the agent's pod and for the CNI plugin containerd runs; /var/log, where the
  kubelet links container logs): other agents on this host keep theirs.
- cgroups: cgroup v1 here (no systemd as PID 1), so ``cgroupDriver: cgroupfs``,
  ``failCgroupV1: false`` and a private ``cgroupRoot`` ``/kn<hex>`` in every hierarchy,
  removed at the end.
- containerd (Debian's 1.6; kubelet 1.37 falls back to its own cgroup driver setting
  when the runtime does not answer RuntimeConfig): private config, root, state, socket,
  runc root, CNI conf and bin dirs, overlayfs snapshotter, a locally built sandbox image.

Everything is torn down by :meth:`RealNode.close` in reverse order, also after a failure.
Needs root.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import yaml

from agent.core.netns import run_in_netns_thread
from tests.kube import cluster as kc
from tests.node import images

ROOT = Path(__file__).resolve().parents[2]
NODE_SCRIPT = ROOT / "scripts" / "kube-test-node.sh"
PAUSE_IMAGE = "localhost/ambient-node-test/pause:1"
BUSYBOX_IMAGE = "localhost/ambient-node-test/busybox:1"
SERVICE_VIP = "10.96.0.1"
CGROUP_V1 = ("cpu", "cpuacct", "cpuset", "memory", "devices", "freezer", "blkio", "pids",
             "systemd", "hugetlb", "net_cls", "net_prio", "perf_event")
# the kubelet's wanted values (pkg/util/sysctl), shown to it in the node's mount namespace
KUBELET_SYSCTLS = {"vm/overcommit_memory": "1", "vm/panic_on_oom": "0", "kernel/panic": "10",
                   "kernel/panic_on_oops": "1", "kernel/keys/root_maxkeys": "1000000",
                   "kernel/keys/root_maxbytes": "25000000"}
CNI_PLUGINS = ("bridge", "host-local", "loopback", "portmap")
# host paths the node sees as dirs of its own (bind mounts in its mount namespace): the
# DaemonSet's socket dirs, which must have the same path in the agent's pod and for the
# CNI plugin containerd runs, and where the kubelet links container logs
NODE_DIRS = ("/var/run/ambient-agent", "/var/run/ztunnel", "/var/log")
# containerd's second runtime handler (RuntimeClass handler): runc, with a CNI config dir
# of its own that no agent touches (benchmarks/bench_node.py's floor)
BARE_HANDLER = "bare"


def build() -> Path:
    """scripts/kube-test-node.sh build: the binaries' dir. Raises RuntimeError."""
    proc = subprocess.run(["bash", str(NODE_SCRIPT), "build"], capture_output=True, text=True)
    if proc.returncode:
        tail = " | ".join(proc.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"scripts/kube-test-node.sh build failed (exit {proc.returncode}): "
                           f"{tail}")
    return Path(proc.stdout.strip())


def why_not() -> str | None:
    """Why a real node cannot run here (None: it can)."""
    if os.geteuid() != 0:
        return "needs root: a real node (containerd, kubelet, netns, cgroups) runs as root"
    proc = subprocess.run(["bash", str(NODE_SCRIPT), "check"], capture_output=True, text=True)
    if proc.returncode:
        return f"scripts/kube-test-node.sh check: {proc.stdout.strip()} {proc.stderr.strip()}"
    if not (shutil.which("go") or os.access("/usr/local/go/bin/go", os.X_OK)):
        return "needs Go to build the kubelet and the controllers"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Forwarder:
    """TCP forwarding from listeners in the node's netns to 127.0.0.1:<port> on the host.

    Runs its own event loop on a thread; listening sockets are made in the node netns (a
    socket keeps the netns it was created in), connections to the target from the loop's
    thread (the host netns)."""

    def __init__(self, netns_path: str, target_port: int):
        self.netns_path = netns_path
        self.target_port = target_port
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="node-forward",
                                       daemon=True)
        self.servers: list[asyncio.base_events.Server] = []
        self.thread.start()

    def listen(self, host: str, port: int) -> None:
        def make() -> socket.socket:
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
            s.listen(128)
            s.setblocking(False)
            return s
        sock = run_in_netns_thread(self.netns_path, make)
        fut = asyncio.run_coroutine_threadsafe(asyncio.start_server(self._serve, sock=sock),
                                               self.loop)
        self.servers.append(fut.result(10))

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            r2, w2 = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            try:
                while data := await r.read(65536):
                    w.write(data)
                    await w.drain()
            except (OSError, asyncio.CancelledError):
                pass
            finally:
                w.close()
        await asyncio.gather(pipe(reader, w2), pipe(r2, writer))

    def close(self) -> None:
        async def stop() -> None:
            for s in self.servers:
                s.close()
            for t in asyncio.all_tasks():
                if t is not asyncio.current_task():
                    t.cancel()
        if self.thread.is_alive():
            asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


class RealNode:
    """The node (see the module docstring). Build with :meth:`start`; :meth:`close` always."""

    def __init__(self, bin_dir: Path):
        self.bin = bin_dir
        self.suffix = secrets.token_hex(3)
        self.name = f"node-{self.suffix}"
        self.root = Path(tempfile.mkdtemp(prefix=f"kn{self.suffix}", dir="/tmp"))
        self.netns = f"kn{self.suffix}"
        self.netns_path = f"/var/run/netns/{self.netns}"
        self.cgroup_root = f"/kn{self.suffix}"
        self.node_ip = f"172.31.{secrets.randbelow(250) + 1}.{secrets.randbelow(250) + 2}"
        self.pod_subnet = f"10.{100 + secrets.randbelow(100)}.{secrets.randbelow(250)}.0/24"
        self.cni_conf_dir = self.root / "etc/cni/net.d"
        self.cni_bin_dir = self.root / "opt/cni/bin"
        # a second runtime handler with a CNI config of its own (the benchmark's floor)
        self.cni_conf_dir_bare = self.root / "etc/cni/net.d-bare"
        self.pod_subnet_bare = f"10.{200 + secrets.randbelow(50)}.{secrets.randbelow(250)}.0/24"
        self.sock = self.root / "containerd.sock"
        self.procs: dict[str, subprocess.Popen] = {}
        self.cleanups: list = []
        self.cluster: kc.KubeCluster | None = None
        self.forwarder: Forwarder | None = None
        self.mntns_holder: subprocess.Popen | None = None

    # --- lifecycle ---

    def later(self, fn, *args, **kwargs) -> None:
        self.cleanups.append((fn, args, kwargs))

    def close(self) -> list[str]:
        """Undo everything, newest first; returns the cleanup errors (also printed)."""
        errors = []
        for fn, args, kwargs in reversed(self.cleanups):
            try:
                fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - clean up the rest regardless
                errors.append(f"{getattr(fn, '__name__', fn)}: {e}")
        self.cleanups.clear()
        shutil.rmtree(self.root, ignore_errors=True)
        for e in errors:
            print(f"realnode cleanup: {e}")
        return errors

    def start(self, cluster_dir: Path) -> None:
        """API server, node netns, controllers, containerd (images imported by the caller
        with :meth:`import_image` before :meth:`start_kubelet`)."""
        self.start_apiserver(cluster_dir)
        self.start_netns()
        self.start_controllers()
        self.start_mount_namespace()
        self.start_containerd()

    def start_apiserver(self, directory: Path) -> None:
        script = kc.SCRIPT
        env = dict(os.environ, KUBE_TEST_OWNER_PID=str(os.getpid()))
        self.later(self._stop_cluster, directory)
        proc = subprocess.run(["bash", script, "start", str(directory)], capture_output=True,
                              text=True, env=env, timeout=240)
        if proc.returncode:
            raise RuntimeError(f"kube-test-apiserver.sh start failed: {proc.stderr[-2000:]}")
        self.cluster = kc.KubeCluster(str(directory))
        self.api_port = int(self.cluster.env["KUBE_APISERVER_PORT"])
        self._node_kubeconfig()

    def _stop_cluster(self, directory: Path) -> None:
        """Stop the API server and etcd of ``directory``: the script's ``stop`` (graceful),
        then SIGKILL to the process group of each of them (and of the owner watchdog)
        still alive. The script starts each under ``setsid``, so each is the leader of its
        own group; the pids come from its pid files, read first (``stop`` removes the
        directory), and a pid is signalled only while its command line still names
        ``directory`` (never a reused pid). Also covers a start cut short before the
        script's own watchdog existed."""
        directory = Path(directory).resolve()  # as the script records it
        pids = []
        for name in ("kube-apiserver.pid", "etcd.pid", "watchdog.pid"):
            try:
                pids.append(int((directory / name).read_text().split()[0]))
            except (OSError, ValueError, IndexError):
                continue
        try:
            subprocess.run(["bash", kc.SCRIPT, "stop", str(directory)], capture_output=True,
                           timeout=90)
        finally:
            for pid in pids:
                try:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                except OSError:
                    continue  # gone
                if str(directory).encode() not in cmdline:
                    continue
                try:
                    os.killpg(pid, signal.SIGKILL)
                except OSError:
                    pass

    def _node_kubeconfig(self) -> None:
        """A client certificate for ``system:node:<name>`` (group ``system:nodes``, which
        the Node authorizer and RBAC's system:node role serve), signed by the test CA."""
        d = Path(self.cluster.directory)
        key, csr, crt = self.root / "node.key", self.root / "node.csr", self.root / "node.crt"
        ext = self.root / "node.ext"
        ext.write_text("extendedKeyUsage=clientAuth\nkeyUsage=digitalSignature,keyEncipherment\n")
        subprocess.run(["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                        "-out", str(csr), "-subj", f"/O=system:nodes/CN=system:node:{self.name}"],
                       check=True, capture_output=True)
        subprocess.run(["openssl", "x509", "-req", "-in", str(csr), "-CA", str(d / "ca.crt"),
                        "-CAkey", str(d / "ca.key"), "-CAcreateserial", "-CAserial",
                        str(self.root / "ca.srl"), "-days", "2", "-extfile", str(ext),
                        "-out", str(crt)], check=True, capture_output=True)
        self.node_kubeconfig = self.root / "kubelet.kubeconfig"
        self.node_kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "kube-test", "cluster": {
                "server": f"https://127.0.0.1:{self.api_port}",
                "certificate-authority": str(d / "ca.crt")}}],
            "users": [{"name": "node", "user": {"client-certificate": str(crt),
                                                "client-key": str(key)}}],
            "contexts": [{"name": "node", "context": {"cluster": "kube-test", "user": "node"}}],
            "current-context": "node"}))

    def start_netns(self) -> None:
        self.later(self._remove_netns)
        subprocess.run(["ip", "netns", "add", self.netns], check=True)
        ip = ["ip", "-n", self.netns]
        subprocess.run([*ip, "link", "set", "lo", "up"], check=True)
        subprocess.run([*ip, "addr", "add", f"{SERVICE_VIP}/32", "dev", "lo"], check=True)
        # the node's "NIC" (no dummy driver in this kernel: a veth pair, both ends here)
        subprocess.run([*ip, "link", "add", "node0", "type", "veth", "peer", "name", "node0p"],
                       check=True)
        subprocess.run([*ip, "addr", "add", f"{self.node_ip}/32", "dev", "node0"], check=True)
        subprocess.run([*ip, "link", "set", "node0", "up"], check=True)
        subprocess.run([*ip, "link", "set", "node0p", "up"], check=True)
        self.forwarder = Forwarder(self.netns_path, self.api_port)
        self.later(self.forwarder.close)
        self.forwarder.listen("127.0.0.1", self.api_port)
        self.forwarder.listen(SERVICE_VIP, 443)

    def _remove_netns(self) -> None:
        subprocess.run(["ip", "netns", "del", self.netns], capture_output=True)

    # --- processes ---

    def _spawn(self, name: str, argv: list[str], node_ns: bool = False,
               env: dict | None = None) -> subprocess.Popen:
        if node_ns:
            argv = ["nsenter", f"--net={self.netns_path}",
                    f"--mount=/proc/{self.mntns_holder.pid}/ns/mnt", "--", *argv]
        log = open(self.root / f"{name}.log", "ab")  # noqa: SIM115 - the child keeps it
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                             start_new_session=True, env=env or dict(os.environ))
        log.close()
        self.procs[name] = p
        self.later(self._stop, name)
        return p

    def _stop(self, name: str, grace: float = 15) -> None:
        p = self.procs.pop(name, None)
        if p is None or p.poll() is not None:
            return
        p.terminate()
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)

    def log(self, name: str, tail: int = 6000) -> str:
        try:
            return (self.root / f"{name}.log").read_text(errors="replace")[-tail:]
        except OSError:
            return ""

    def check_alive(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                raise AssertionError(f"{name} exited with {p.returncode}:\n{self.log(name)}")

    def start_controllers(self) -> None:
        d = Path(self.cluster.directory)
        admin = str(d / "admin.kubeconfig")
        self._spawn("kube-controller-manager", [
            str(self.bin / "kube-controller-manager"), "--kubeconfig", admin,
            "--authentication-kubeconfig", admin, "--authorization-kubeconfig", admin,
            "--bind-address", "127.0.0.1", "--secure-port", str(free_port()),
            "--leader-elect=false", "--use-service-account-credentials=true",
            "--service-account-private-key-file", str(d / "sa.key"),
            "--root-ca-file", str(d / "ca.crt"),
            "--controllers", "*", "--concurrent-daemonset-syncs", "2",
            "--node-monitor-grace-period", "60s", "--v", "1"])
        self._spawn("kube-scheduler", [
            str(self.bin / "kube-scheduler"), "--kubeconfig", admin,
            "--authentication-kubeconfig", admin, "--authorization-kubeconfig", admin,
            "--bind-address", "127.0.0.1", "--secure-port", str(free_port()),
            "--leader-elect=false", "--v", "1"])

    def start_mount_namespace(self) -> None:
        """The holder of the node's mount namespace (see the module docstring)."""
        sysctl = self.root / "sysctl"
        binds = []
        for name, value in KUBELET_SYSCTLS.items():
            f = sysctl / name.replace("/", "_")
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(value + "\n")
            binds.append(f"mount --bind {f} /proc/sys/{name}")
        for path in NODE_DIRS:
            target = Path(path)
            if not target.exists():  # a mount point on the host, removed at the end
                target.mkdir(parents=True)
                self.later(_rmdir_quiet, target)
            self.host_path(path).mkdir(parents=True, exist_ok=True)
            binds.append(f"mount --bind {self.host_path(path)} {target.resolve()}")
        ready = self.root / "mntns.ready"
        # "/" shared within the node (as on a systemd host; containerd checks it for the
        # DaemonSet's HostToContainer mount of /var/run/netns, a path through the /var/run
        # symlink): new peer groups only here, since the host's "/" is private
        script = " && ".join(["mount --make-rshared /", "mount --make-rprivate /proc", *binds,
                              f"touch {ready}",
                              "exec sleep infinity"])
        log = open(self.root / "mntns.log", "ab")  # noqa: SIM115
        self.mntns_holder = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "unchanged", "bash", "-c", script],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        log.close()
        self.later(self._stop_holder)
        deadline = time.monotonic() + 10
        while not ready.exists():
            if self.mntns_holder.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mount namespace holder failed: {self.log('mntns')}")
            time.sleep(0.05)

    def host_path(self, path: str) -> Path:
        """Where the node's ``path`` (under one of :data:`NODE_DIRS`) is on the host."""
        for d in NODE_DIRS:
            if path == d or path.startswith(d + "/"):
                return self.root / "node-fs" / path.lstrip("/")
        raise ValueError(f"{path} is the host's own on this node")

    def _stop_holder(self) -> None:
        p = self.mntns_holder
        if p and p.poll() is None:
            p.kill()
            p.wait(10)

    def start_containerd(self) -> None:
        r = self.root
        for d in (self.cni_conf_dir, self.cni_conf_dir_bare, self.cni_bin_dir):
            d.mkdir(parents=True, exist_ok=True)
        for plugin in CNI_PLUGINS:
            shutil.copy(f"/usr/lib/cni/{plugin}", self.cni_bin_dir / plugin)
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        config = f"""version = 2
root = "{r}/containerd/root"
state = "{r}/containerd/state"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.devmapper"]
[grpc]
  address = "{self.sock}"
[ttrpc]
  address = "{self.sock}.ttrpc"
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "{r}/containerd/opt"
[{cri}]
  sandbox_image = "{PAUSE_IMAGE}"
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  disable_apparmor = true
  # never below containerd's own (this host refuses lowering it: no CAP_SYS_RESOURCE)
  restrict_oom_score_adj = true
  [{cri}.containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [{cri}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [{cri}.containerd.runtimes.runc.options]
        SystemdCgroup = false
        BinaryName = "{os.environ.get('KN_RUNC') or shutil.which('runc')}"
        Root = "{r}/runc"
    [{cri}.containerd.runtimes.{BARE_HANDLER}]
      runtime_type = "io.containerd.runc.v2"
      cni_conf_dir = "{self.cni_conf_dir_bare}"
      cni_max_conf_num = 1
      [{cri}.containerd.runtimes.{BARE_HANDLER}.options]
        SystemdCgroup = false
        BinaryName = "{os.environ.get('KN_RUNC') or shutil.which('runc')}"
        Root = "{r}/runc"
  [{cri}.cni]
    bin_dir = "{self.cni_bin_dir}"
    conf_dir = "{self.cni_conf_dir}"
    max_conf_num = 1
"""
        # KN_RUNC: another runc binary (e.g. a wrapper adding --debug, to read nsexec's errors)
        (r / "containerd.toml").write_text(config)
        self.later(self._reap_shims)
        self._spawn("containerd", ["containerd", "--config", str(r / "containerd.toml")],
                    node_ns=True)
        deadline = time.monotonic() + 30
        while self.ctr("version", check=False).returncode:
            self.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"containerd did not answer: {self.log('containerd')}")
            time.sleep(0.2)

    def ctr(self, *args: str, check: bool = True, timeout: float = 120
            ) -> subprocess.CompletedProcess:
        return subprocess.run(["ctr", "--address", str(self.sock), "--namespace", "k8s.io",
                               *args], capture_output=True, text=True, check=check,
                              timeout=timeout)

    def import_image(self, tar: Path) -> None:
        self.ctr("images", "import", str(tar), timeout=300)

    def import_test_images(self) -> None:
        images.pause_image(self.root / "pause.tar", PAUSE_IMAGE, self.bin / "pause")
        images.busybox_image(self.root / "busybox.tar", BUSYBOX_IMAGE)
        self.import_image(self.root / "pause.tar")
        self.import_image(self.root / "busybox.tar")

    def _sandbox_netns(self) -> list[str]:
        """The netns files of this containerd's pod sandboxes (from the CRI plugin's
        sandbox metadata)."""
        out = self.ctr("containers", "list", "-q", "labels.io.cri-containerd.kind==sandbox",
                       check=False, timeout=20).stdout.split()
        paths = []
        for cid in out:
            info = self.ctr("containers", "info", cid, check=False, timeout=20).stdout
            try:
                ext = json.loads(info).get("Extensions", {})
                meta = ext.get("io.cri-containerd.sandbox.metadata", {}).get("value")
                if meta:
                    import base64
                    m = json.loads(base64.b64decode(meta))
                    p = (m.get("Metadata") or {}).get("NetNSPath")
                    if p:
                        paths.append(p)
            except (ValueError, AttributeError):
                continue
        return paths

    def _reap_shims(self) -> None:
        """After containerd stopped: end its shims (they outlive it) and their containers,
        and remove the pods' netns files it left."""
        for pid in self._shim_pids():
            try:
                os.killpg(os.getpgid(pid), signal.SIGKILL)
            except OSError:
                pass
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for path in getattr(self, "_netns_seen", []):
            if os.path.exists(path):
                subprocess.run(["umount", path], capture_output=True)
                try:
                    os.unlink(path)
                except OSError:
                    pass

    def _shim_pids(self) -> list[int]:
        mine = []
        needle = str(self.sock).encode()
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            if b"containerd-shim" in cmd and needle in cmd:
                mine.append(int(pid))
        return mine

    def remember_netns(self) -> None:
        """Record the sandboxes' netns files (removed at cleanup if containerd leaves them)."""
        seen = set(getattr(self, "_netns_seen", []))
        seen.update(self._sandbox_netns())
        self._netns_seen = sorted(seen)

    def start_kubelet(self) -> None:
        r = self.root
        self._make_cgroup_root()
        (r / "resolv.conf").write_text("nameserver 127.0.0.1\n")
        d = Path(self.cluster.directory)
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "address": "127.0.0.1", "healthzBindAddress": "127.0.0.1", "readOnlyPort": 0,
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False},
                               "x509": {"clientCAFile": str(d / "ca.crt")}},
            "authorization": {"mode": "AlwaysAllow"},
            "cgroupDriver": "cgroupfs", "cgroupRoot": self.cgroup_root, "failCgroupV1": False,
            "failSwapOn": False,
            "containerRuntimeEndpoint": f"unix://{self.sock}",
            "resolvConf": str(r / "resolv.conf"), "clusterDomain": "cluster.local",
            "podLogsDir": str(r / "pod-logs"), "volumePluginDir": str(r / "volume-plugins"),
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "evictionHard": {"memory.available": "1Mi", "nodefs.available": "1%",
                             "imagefs.available": "1%", "nodefs.inodesFree": "1%"},
            "nodeStatusUpdateFrequency": "5s", "syncFrequency": "5s",
            "serializeImagePulls": False, "maxPods": 60, "registerNode": True,
            "rotateCertificates": False, "serverTLSBootstrap": False,
        }
        (r / "kubelet.yaml").write_text(yaml.safe_dump(config))
        self._spawn("kubelet", [
            str(self.bin / "kubelet"), "--config", str(r / "kubelet.yaml"),
            "--kubeconfig", str(self.node_kubeconfig), "--root-dir", str(r / "kubelet"),
            "--hostname-override", self.name, "--node-ip", self.node_ip, "--v", "2"],
            node_ns=True)

    def _make_cgroup_root(self) -> None:
        self.later(self._remove_cgroups)
        for sub in CGROUP_V1:
            base = Path("/sys/fs/cgroup") / sub
            if not base.is_dir():
                continue
            (base / self.cgroup_root.lstrip("/")).mkdir(exist_ok=True)
            if sub == "cpuset":
                for f in ("cpuset.cpus", "cpuset.mems"):
                    (base / self.cgroup_root.lstrip("/") / f).write_text(
                        (base / f).read_text())
        unified = Path("/sys/fs/cgroup/unified")
        if unified.is_dir():
            (unified / self.cgroup_root.lstrip("/")).mkdir(exist_ok=True)

    def _remove_cgroups(self) -> None:
        for sub in (*CGROUP_V1, "unified"):
            top = Path("/sys/fs/cgroup") / sub / self.cgroup_root.lstrip("/")
            if not top.is_dir():
                continue
            for dirpath, _dirs, _files in sorted(os.walk(top), key=lambda t: -len(t[0])):
                for _ in range(50):
                    try:
                        os.rmdir(dirpath)
                        break
                    except OSError:
                        procs = Path(dirpath) / "cgroup.procs"
                        try:
                            for pid in procs.read_text().split():
                                os.kill(int(pid), signal.SIGKILL)
                        except OSError:
                            pass
                        time.sleep(0.1)


def _rmdir_quiet(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass
