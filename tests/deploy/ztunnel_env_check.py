"""What ztunnel does first with its pod's env, done by the clients written from ztunnel's
source (tests/ztunnel_exact: its control-plane TLS, delta xDS and CA clients), for the
DaemonSet-on-podman test when no ztunnel binary is at hand.

Run as ``python -m tests.deploy.ztunnel_env_check`` inside the ztunnel pod's network
namespace (``ip netns exec``), with one JSON object on stdin: ``env`` (the container's
env as kubelet resolves it: ``$(HOST_IP)`` expanded, fieldRefs filled in) and ``mounts``
(container path -> the host directory standing in for that volume). It reads
``XDS_ROOT_CA``/``CA_ROOT_CA``/``AUTH_TOKEN`` through the mounts, opens ztunnel's xDS
stream to ``XDS_ADDRESS`` (verifying the server as ``ALT_XDS_HOSTNAME``) until ztunnel
would be ready, and asks ``CA_ADDRESS`` for the certificate of ``identity`` (a pod on
the node; ``PROXY_MODE`` shared: with ``ImpersonatedIdentity``). Prints one JSON object: ``xds_types``
(resource types received), ``xds_resources``, ``ca_identity``, ``ca_issuer``; exits 1
printing ``{"error": ...}`` on any failure.
"""

from __future__ import annotations

import asyncio
import json
import sys


def host_path(path: str, mounts: dict[str, str]) -> str:
    """The host file behind a container path (the longest mount prefix)."""
    best = max((m for m in mounts if path == m or path.startswith(m.rstrip("/") + "/")),
               key=len, default=None)
    if best is None:
        raise FileNotFoundError(f"{path} is on no volume of the pod")
    return mounts[best] + path[len(best):]


async def check(env: dict[str, str], mounts: dict[str, str], identity: str) -> dict:
    from cryptography import x509

    from tests.ztunnel_exact.ca import ZtunnelCaClient
    from tests.ztunnel_exact.xds import ZtunnelEnv, ZtunnelXdsClient, load_token

    def read(name: str) -> bytes:
        with open(host_path(env[name], mounts), "rb") as f:
            return f.read()

    token = load_token(host_path(env["AUTH_TOKEN"], mounts))
    cluster = env.get("ISTIO_META_CLUSTER_ID") or env.get("CLUSTER_ID") or "Kubernetes"
    xds = ZtunnelXdsClient(ZtunnelEnv(
        xds_address=env["XDS_ADDRESS"], xds_root_ca=read("XDS_ROOT_CA"), token=token,
        cluster_id=cluster, alt_xds_hostname=env.get("ALT_XDS_HOSTNAME"),
        instance_ip=env.get("INSTANCE_IP", "1.1.1.1"), pod_name=env.get("POD_NAME", ""),
        pod_namespace=env.get("POD_NAMESPACE", ""), node_name=env.get("NODE_NAME", "")))
    await xds.start()
    try:
        await xds.wait_ready(timeout=30)
        types = sorted({r.type_url for r in xds.responses})
        count = sum(len(v) for v in xds.resources.values())
    finally:
        await xds.close()
    ca = ZtunnelCaClient(env["CA_ADDRESS"], read("CA_ROOT_CA"), token=token,
                         cluster_id=cluster, alt_hostname=env.get("ALT_CA_HOSTNAME"))
    await ca.start()
    try:
        cert = await ca.fetch_certificate(identity, timeout=20)
    finally:
        await ca.close()
    root = x509.load_pem_x509_certificate(read("CA_ROOT_CA"))
    # the leaf chains to the root the pod mounts (the chain's last element is issued by it)
    chain = [cert.leaf, *cert.chain]
    for child, parent in zip(chain, chain[1:]):
        child.verify_directly_issued_by(parent)
    if chain[-1] != root:
        chain[-1].verify_directly_issued_by(root)
    return {"xds_types": types, "xds_resources": count, "ca_identity": cert.identity,
            "ca_issuer": cert.leaf.issuer.rfc4514_string(),
            "root_subject": root.subject.rfc4514_string()}


def main() -> int:
    req = json.load(sys.stdin)
    try:
        out = asyncio.run(check(req["env"], req["mounts"], req["identity"]))
    except Exception as e:  # noqa: BLE001 - the caller shows the reason
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        return 1
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
