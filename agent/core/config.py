"""Agent configuration: one table of settings, resolved with a fixed precedence.

Precedence (highest first): command-line flag > environment variable > YAML config
file > built-in default. Environment names are Istio's where Istio has one
(``NODE_NAME``, ``TRUST_DOMAIN``, ``ZTUNNEL_UDS_ADDRESS``, ``SECRET_TTL``,
``ISTIO_KUBE_APP_PROBERS``, ...; the README's settings table lists them), otherwise
``AMBIENT_AGENT_<NAME>``.

Every resolved value remembers where it came from, so ``ambient-agent config`` can
print "value (source)". Bad values raise :class:`ConfigError` naming the setting,
the value and the reason; the CLI turns that into one line on stderr, never a
traceback. Everything checkable without starting a component is checked in
:func:`load`: files that must exist (certificates, keys, tokens), bind addresses (IP
literals), directories, namespace and account names, JSON settings (with the status
server's own parsers) and rules across settings (:mod:`agent.core.config_checks`).

To add a setting, append a :class:`Setting` to ``SETTINGS``; it becomes a flag
(``--name-with-dashes``), a config-file key (``name_with_underscores``) and an
environment variable automatically. Then run ``python scripts/gen_config_fields.py``:
it writes the setting's typed attribute into :mod:`agent.core.config_fields` (the
parser's return annotation is its type), and tests/test_config_fields.py fails until
that file matches the table. The parsers live in :mod:`agent.core.config_values`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import ipaddress
import os
import socket
import stat
import types
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import yaml

from agent.core import config_checks, trusted, yamlsafe
from agent.core.config_fields import Settings
from agent.core.config_values import (
    choice, ip_of, parse_account_list, parse_app_probers, parse_bind_address, parse_bool,
    parse_count, parse_dir_path, parse_duration, parse_existing_file, parse_file_mode,
    parse_file_name, parse_host_port, parse_json, parse_list, parse_log_level, parse_name,
    parse_cert_ttl, parse_namespace, parse_namespace_list, parse_path, parse_port, parse_ratio,
    parse_service_account, parse_signature_algorithm, parse_str, parse_token_file,
    parse_trust_domain, positive, required,
)


class ConfigError(ValueError):
    """A setting has a value the agent can't use.

    ``setting`` is the setting name, ``value`` the offending value, ``reason`` a
    short explanation; ``str()`` gives one human line with all three.
    """

    def __init__(self, setting: str, value: Any, reason: str, origin: str = ""):
        self.setting, self.value, self.reason, self.origin = setting, value, reason, origin
        where = f" (from {origin})" if origin else ""
        super().__init__(f"invalid setting {setting}={value!r}{where}: {reason}")


# What each parser accepts, as ``--help`` names it (:attr:`Setting.metavar`).
_TYPE_NAMES = {
    "parse_duration": "SECONDS", "parse_bool": "BOOL", "parse_port": "PORT",
    "parse_path": "PATH", "parse_dir_path": "DIR", "parse_existing_file": "FILE",
    "parse_list": "LIST", "parse_namespace_list": "NAMESPACES", "parse_namespace": "NAMESPACE",
    "parse_name": "NAME", "parse_service_account": "NS/SA", "parse_account_list": "NS/SA,...",
    "parse_bind_address": "ADDRESS", "parse_host_port": "HOST:PORT", "parse_log_level": "LEVEL",
    "parse_json": "JSON", "parse_app_probers": "JSON", "parse_ratio": "RATIO",
    "parse_file_mode": "MODE", "parse_file_name": "FILENAME", "parse_trust_domain": "DOMAIN",
    "parse_signature_algorithm": "ALGORITHM", "parse_positive": "SECONDS",
}


@dataclasses.dataclass(frozen=True)
class Setting:
    """One configuration knob.

    ``name`` is the config-file key and attribute name; the flag is ``--`` + name with
    dashes; ``env`` is the environment variable (Istio's name where one exists).
    ``default`` may be a callable taking the partially-resolved values (for defaults
    derived from other settings, e.g. paths under ``state_dir``).
    """

    name: str
    default: Any
    parse: Callable[[Any], Any]
    help: str
    env: str | None = None
    component: str = "agent"

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env_name(self) -> str:
        return self.env or "AMBIENT_AGENT_" + self.name.upper()

    @property
    def env_alias(self) -> str | None:
        """``AMBIENT_AGENT_<NAME>`` for a setting whose variable is Istio's: every setting
        answers to the project's prefix too (a user, and once our own docs, wrote
        ``AMBIENT_AGENT_CNI_CONF_NAME`` for ``CNI_CONF_NAME`` and it was ignored)."""
        alias = "AMBIENT_AGENT_" + self.name.upper()
        return None if alias == self.env_name else alias

    @property
    def metavar(self) -> str:
        """What ``--help`` names the value: ``{a,b}`` for a choice, else its kind
        (``SECONDS``, ``PORT``, ``IP``, ``DIR``...; ``VALUE`` when none is known)."""
        choices = getattr(self.parse, "choices", None)
        if choices:
            return "{" + ",".join(choices) + "}"
        name = getattr(self.parse, "__name__", "")
        if name == "parse" and "ip" in getattr(self.parse, "__qualname__", ""):
            return "IP"
        return _TYPE_NAMES.get(name, "VALUE")

    @property
    def shown_default(self) -> str:
        """The default as ``--help`` shows it: ``none`` for an empty one, ``a,b`` for a
        tuple, ``true``/``false``, ``hostname`` for ``node_name``, ``derived from other
        settings`` for the other computed ones."""
        if callable(self.default):
            return "hostname" if self.name == "node_name" else "derived from other settings"
        if self.default in (None, "", ()):
            return "none"
        if isinstance(self.default, tuple):
            return ",".join(str(v) for v in self.default)
        if isinstance(self.default, bool):
            return "true" if self.default else "false"
        return str(self.default)


def _under_state(*parts: str) -> Callable[[dict], str]:
    return lambda values: os.path.join(values["state_dir"], *parts)


# What the three listener caps share (agent.core.fdbudget): the caps together may use the
# open-files limit less the fds kept for the node-local sockets pods depend on.
_FD_BUDGET = ("; 0: as many as the open-files limit allows. The status, health and xDS "
              "caps are scaled down together when their sum would leave fewer than a "
              "quarter of the open-files limit (at least 256 fds) for node-local sockets "
              "(one log line at start)")


SETTINGS: list[Setting] = [
    # --- process ---
    Setting("state_dir", "/var/run/ambient-agent", required(parse_dir_path),
            "directory holding every socket and file the agent creates"),
    Setting("config_file", "/etc/ambient-agent/config.yaml", parse_path,
            "YAML file of settings (keys = setting names); a missing default file is ignored"),
    Setting("log_level", "info", parse_log_level,
            "log level, or per scope (package path; sds, status = agent.sds, agent.status): "
            "'info,zds:debug,sds:warning'", env="LOG_LEVEL"),
    Setting("log_format", "text", choice("text", "json"), "log line format: text or json"),
    Setting("shutdown_grace", 5.0, parse_duration,
            "how long in-flight work may take after SIGTERM before the agent exits",
            env="TERMINATION_DRAIN_DURATION_SECONDS"),
    Setting("node_name", lambda v: socket.gethostname(), parse_name,
            "this node's name; pods of other nodes are ignored", env="NODE_NAME"),
    # --- ambient index / config source ---
    Setting("config_source", "files", choice("files", "kubernetes"),
            "where pods, services and policies come from", component="ambient"),
    Setting("config_dir", _under_state("cluster"), required(parse_dir_path),
            "directory of Kubernetes/Istio YAML the files source reads and watches",
            component="ambient"),
    Setting("kubeconfig", "", parse_path, "kubeconfig for the kubernetes source "
            "(empty: in-cluster credentials)", env="KUBECONFIG", component="ambient"),
    Setting("cluster_id", "Kubernetes", parse_name, "cluster name used in workload UIDs and CA "
            "requests", env="CLUSTER_ID", component="ambient"),
    Setting("network", "", parse_str, "network name of this cluster", env="NETWORK",
            component="ambient"),
    Setting("trust_domain", "cluster.local", parse_trust_domain, "SPIFFE trust domain",
            env="TRUST_DOMAIN"),
    Setting("system_namespace", "istio-system", parse_namespace, "Istio system namespace",
            env="SYSTEM_NAMESPACE"),
    # --- workload registration (hosts without Kubernetes: cni.registration) ---
    Setting("workload_registration", "none", choice("none", "local", "workloadentry"),
            "register the pods CNI ADDs create: none; local (Pod objects in this agent's "
            "store); workloadentry (WorkloadEntry objects in the Kubernetes API server of "
            "config_source kubernetes, shared by several hosts)", component="cni"),
    Setting("registration_namespace", "default", parse_namespace,
            "namespace of registered pods without an io.kubernetes.pod.namespace label",
            component="cni"),
    Setting("registration_runtime", "podman", choice("podman", "none"),
            "where container labels of registered pods come from", component="cni"),
    Setting("podman_containers_conf", "", parse_existing_file,
            "containers.conf podman runs with (CONTAINERS_CONF; empty: podman's default)",
            component="cni"),
    Setting("registration_grace", 10.0, positive(parse_duration),
            "workloadentry: how long a host's WorkloadEntries outlive its last heartbeat "
            "(Istio's PILOT_WORKLOAD_ENTRY_GRACE_PERIOD)", component="cni"),
    # --- CNI and enrollment ---
    Setting("cni_event_socket", _under_state("pluginevent.sock"), required(parse_path),
            "Unix socket the istio-cni plugin posts pod events to", component="cni"),
    Setting("cni_manage_config", False, parse_bool,
            "install istio-cni into the CNI conf dir at start and repair it (it stays at "
            "stop unless ambient_disable_safe_upgrade)",
            component="cni"),
    Setting("cni_conf_dir", "/etc/cni/net.d", required(parse_path),
            "CNI network config directory",
            env="MOUNTED_CNI_NET_DIR", component="cni"),
    Setting("cni_bin_dir", "/opt/cni/bin", required(parse_path), "CNI plugin binary directory",
            env="CNI_BIN_DIR", component="cni"),
    Setting("cni_conf_name", "", parse_file_name, "conflist to chain into (empty: first by name)",
            env="CNI_CONF_NAME", component="cni"),
    Setting("cni_plugin_bundle", "", parse_path, "standalone istio-cni build "
            "(scripts/build-cni-plugin.py) that cni install copies into cni_bin_dir; the image "
            "sets it (empty: a launcher running this agent's own Python and checkout)",
            component="cni"),
    Setting("exclude_namespaces", ("kube-system",), parse_namespace_list,
            "namespaces never enrolled", env="EXCLUDE_NAMESPACES", component="cni"),
    Setting("ambient_dns_capture", True, parse_bool, "redirect pod DNS to ztunnel's 15053",
            env="AMBIENT_DNS_CAPTURE", component="cni"),
    Setting("ambient_ipv6", True, parse_bool, "install IPv6 rules too", env="AMBIENT_IPV6",
            component="cni"),
    Setting("native_nftables", False, parse_bool, "use the nftables backend instead of iptables",
            env="NATIVE_NFTABLES", component="cni"),
    Setting("host_probe_snat_ip", "169.254.7.127", ip_of(4),
            "source address kubelet probes are SNATed to", env="HOST_PROBE_SNAT_IP",
            component="cni"),
    Setting("host_probe_snat_ipv6", "fd16:9254:7127:1337:ffff:ffff:ffff:ffff", ip_of(6),
            "IPv6 source address kubelet probes are SNATed to", env="HOST_PROBE_SNAT_IPV6",
            component="cni"),
    Setting("ambient_disable_safe_upgrade", False, parse_bool,
            "remove host probe rules and sets, and (cni_manage_config) istio-cni, at "
            "shutdown (node decommissioned) instead of keeping them for the next agent",
            env="AMBIENT_DISABLE_SAFE_UPGRADE",
            component="cni"),
    Setting("host_mounts_path", "", parse_path, "where the host's paths are mounted in the "
            "agent's container (upstream /host): netns paths a runtime passes "
            "(/proc/<pid>/ns/net, /var/run/netns/...) are opened under it (empty: the agent "
            "runs on the host)", component="cni"),
    Setting("proc_dir", lambda v: (v.get("host_mounts_path") or "") + "/proc", parse_dir_path,
            "where to scan for pod netns on restart and read SDS callers' cgroups "
            "(default <host_mounts_path>/proc)", component="cni"),
    Setting("host_rules_netns", "", parse_path, "netns path for the host probe SNAT rules and "
            "probe sets (empty: the agent's own netns; tests use a scratch netns)",
            component="cni"),
    # --- ZDS ---
    Setting("ztunnel_uds_address", "/var/run/ztunnel/ztunnel.sock", required(parse_path),
            "ZDS socket ztunnel connects to", env="ZTUNNEL_UDS_ADDRESS", component="zds"),
    Setting("ztunnel_wait", 30.0, parse_duration,
            "how long a pod ADD waits for a ztunnel to connect", component="zds"),
    # --- SDS / CA ---
    Setting("sds_socket", _under_state("workload-spiffe-uds", "socket"), required(parse_path),
            "SDS Unix socket", env="WORKLOAD_SPIFFE_UDS", component="sds"),
    Setting("secret_ttl", 24 * 3600.0, parse_cert_ttl, "workload certificate lifetime (at "
            "least 10m)",
            env="SECRET_TTL", component="sds"),
    Setting("secret_grace_ratio", 0.5, parse_ratio, "rotate when this fraction of lifetime is left",
            env="SECRET_GRACE_PERIOD_RATIO", component="sds"),
    Setting("ecc_signature_algorithm", "", parse_signature_algorithm,
            "ECDSA for P-256 workload keys (default RSA 2048)", env="ECC_SIGNATURE_ALGORITHM",
            component="sds"),
    Setting("ca_addr", "", parse_host_port, "Istio CA address host:port (empty: embedded CA)",
            env="CA_ADDR", component="sds"),
    Setting("ca_root_cert", "", parse_existing_file, "root certificate to verify the Istio CA",
            env="CA_ROOT_CERT", component="sds"),
    Setting("ca_token_file", "", parse_existing_file, "bearer token file sent to the Istio CA",
            env="ISTIO_META_TOKEN_FILE", component="sds"),
    Setting("service_account", "", parse_service_account,
            "fixed workload identity's service account (empty: attest callers)",
            env="SERVICE_ACCOUNT", component="sds"),
    Setting("pod_namespace", "default", parse_namespace, "fixed workload identity's namespace",
            env="POD_NAMESPACE", component="sds"),
    Setting("trust_anchors_file", "", parse_existing_file,
            "PEM file of extra trust anchors merged into "
            "ROOTCA, read at start (upstream: mesh ProxyConfig.caCertificatesPem)",
            component="sds"),
    Setting("ca_port", 0, parse_port, "separate TLS port for the embedded CA's "
            "IstioCertificateService (0: served on xds_tls_port only, as istiod serves it on "
            "15012)", component="sds"),
    Setting("ca_listen_address", "0.0.0.0", parse_bind_address,
            "address the separate CA port binds "
            "(callers are authenticated by client cert or token)", component="sds"),
    Setting("ca_cert_file", "", parse_existing_file, "root certificate for the embedded CA (with "
            "ca_key_file; empty: a self-signed root in ca_dir)", component="sds"),
    Setting("ca_key_file", "", parse_existing_file, "private key of ca_cert_file",
            component="sds"),
    Setting("tokens_file", "", parse_existing_file,
            "YAML {token: namespace/serviceaccount} of bearer tokens accepted on the TLS ports "
            "(xDS and CA), for hosts without a Kubernetes API server", component="authn"),
    Setting("token_audiences", ("istio-ca",), parse_list,
            "audiences a Kubernetes service-account token must carry (TokenReview, "
            "config_source kubernetes)", env="TOKEN_AUDIENCES", component="authn"),
    Setting("tls_server_names", (), parse_list,
            "extra DNS names / IPs in the TLS ports' server certificates (besides localhost, "
            "127.0.0.1, ::1, istiod's service names and the node name)",
            env="ISTIOD_CUSTOM_HOST", component="authn"),
    Setting("mesh_root_file", _under_state("mesh-root", "root-cert.pem"), parse_path,
            "where the mesh root is published (0644, directory 0755) for ztunnel's "
            "XDS_ROOT_CA / CA_ROOT_CA (empty: not published)", component="sds"),
    Setting("ca_signer_process", False, parse_bool, "embedded CA: mint SDS workload "
            "certificates in a supervised child process (another CPU for the crypto, which "
            "holds the GIL; see docs/sds.md)", component="sds"),
    Setting("ca_dir", _under_state("ca"), required(parse_dir_path),
            "directory of the embedded CA's self-signed root (created once, reused at every "
            "start: keep it on persistent storage)", component="sds"),
    Setting("ca_trusted_node_accounts", ("istio-system/ztunnel",), parse_account_list,
            "namespace/serviceaccount allowed to request certificates for other identities "
            "(ImpersonatedIdentity)", env="CA_TRUSTED_NODE_ACCOUNTS", component="sds"),
    Setting("workload_certs_dir", "/etc/certs", parse_dir_path, "file-mounted cert-chain.pem, "
            "key.pem, root-cert.pem served as default/ROOTCA when present (fixed identity only)",
            component="sds"),
    # --- CA trust root in Kubernetes (issue 24; agent/sds/ca_kube.py, docs/trust.md) ---
    Setting("ca_kubernetes_secret", True, parse_bool, "config_source kubernetes, embedded CA: "
            "sign with the cluster's CA Secret in system_namespace (cacerts, else "
            "istio-ca-secret, bootstrapped when neither exists) instead of a per-node root",
            component="sds"),
    Setting("ca_root_overlap", 24 * 3600.0, positive(parse_duration), "root rotation: how long "
            "the trust bundle carries the old and new roots before signing switches to the new "
            "key (at least the longest time a peer keeps a certificate before renewing it)",
            component="sds"),
    Setting("ca_root_publish", True, parse_bool, "config_source kubernetes: publish the root "
            "as ConfigMap istio-ca-root-cert in every namespace (one agent at a time, by "
            "Lease; steps aside while istiod's namespace controller holds its election)",
            component="sds"),
    Setting("sds_socket_mode", "0600", parse_file_mode, "octal mode of the SDS socket (upstream "
            "uses 0666 so Envoy as uid 1337 can connect)", component="sds"),
    # --- status server ---
    Setting("status_port", 15020, parse_port, "status server port", env="STATUS_PORT",
            component="status"),
    Setting("health_port", 8000, parse_port, "node agent /healthz and /readyz port",
            component="status"),
    Setting("kube_app_probers", None, parse_app_probers, "rewritten kubelet app probes (JSON)",
            env="ISTIO_KUBE_APP_PROBERS", component="status"),
    Setting("prometheus_annotations", None, parse_json,
            "application metrics targets to merge (JSON)", env="ISTIO_PROMETHEUS_ANNOTATIONS",
            component="status"),
    Setting("envoy_admin_port", 0, parse_port, "Envoy admin port to merge stats and readiness "
            "from (0: no Envoy)", component="status"),
    Setting("status_address", "", parse_bind_address, "address the status and health ports bind "
            "(empty: all addresses)", component="status"),
    Setting("instance_ip", "", ip_of(None, allow_empty=True),
            "pod IP app probes and metrics targets are sent to "
            "(empty: 127.0.0.1)", env="INSTANCE_IP", component="status"),
    Setting("probe_source_ip", "127.0.0.6", ip_of(4, allow_empty=True),
            "source address of IPv4 app probes, "
            "skipped by inbound capture (empty: kernel's choice)", component="status"),
    Setting("probe_source_ipv6", "", ip_of(6, allow_empty=True),
            "source address of IPv6 app probes (empty: "
            "kernel's choice; upstream's ::6 is not a local address on most hosts)",
            component="status"),
    Setting("metrics_localhost_only", False, parse_bool, "serve merged metrics to loopback "
            "clients only", env="METRICS_LOCALHOST_ACCESS_ONLY", component="status"),
    Setting("metrics_created_series", False, parse_bool, "export the _created series of the "
            "agent's counters and histograms (prometheus-client's default; pilot-agent and "
            "istio-cni have none)", env="AMBIENT_AGENT_METRICS_CREATED_SERIES",
            component="status"),
    Setting("admin_socket", _under_state("admin.sock"), required(parse_path),
            "Unix socket (0600, root) serving /quitquitquit, /drain and /debug; "
            "`ambient-agent status` reads it",
            component="status"),
    Setting("status_idle_timeout", 30.0, positive(parse_duration), "status, health and admin "
            "listeners close a connection idle (or stuck in its headers) this long",
            component="status"),
    Setting("status_max_connections", 256, parse_count, "open connections the status port "
            f"accepts (more are answered 503 and closed){_FD_BUDGET}", component="status"),
    Setting("health_max_connections", 64, parse_count, "open connections the health port "
            f"accepts{_FD_BUDGET}", component="status"),
    Setting("xds_max_connections", 256, parse_count, "connections each xDS port accepts"
            f"{_FD_BUDGET}", component="status"),
    # --- per-source connection caps (hardening) ---
    Setting("max_connections_per_source", 16, parse_count, "connections one client address "
            "may hold on each TCP listener (status, health, monitoring, the TLS xDS port); "
            "past it a newcomer replaces that address's oldest unfinished TLS handshake "
            "(TLS port) or least recently active connection (health port), else it is "
            "refused (0: no per-source cap)", component="status"),
    # --- workload xDS ---
    Setting("xds_port", 15010, parse_port, "plaintext workload xDS port", component="xds"),
    Setting("xds_address", "127.0.0.1", parse_bind_address, "address the plaintext xDS port binds",
            component="xds"),
    Setting("xds_tls_port", 15012, parse_port, "TLS port for workload xDS and the embedded "
            "CA, like istiod's 15012; client certificate optional, else a bearer token (0: off)",
            component="xds"),
    Setting("xds_tls_address", "0.0.0.0", parse_bind_address, "address the TLS xDS port binds "
            "(0.0.0.0 or ::: every IPv4 and IPv6 address)", component="xds"),
    Setting("xds_token_file", "", parse_token_file, "if set, clients of the plaintext xDS "
            "port must send 'authorization: Bearer <this file's content>'", component="xds"),
    Setting("xds_debounce", 0.1, parse_duration, "xDS push debounce: quiet period after an "
            "index change", component="xds"),
    Setting("xds_debounce_max", 1.0, parse_duration, "xDS push debounce: longest delay after "
            "the first change of a burst", component="xds"),
    # --- the operator's kit (issue 27): istio-cni's monitoring port and repair settings ---
    Setting("monitoring_port", 15014, parse_port, "istio-cni's node-agent metrics, upstream's "
            "names, on /metrics of this port (0: off); the status port keeps the merged view",
            env="MONITORING_PORT", component="status"),
    Setting("repair_enabled", False, parse_bool, "repair pods that run without their rules "
            "(ambient enabled, enrollment failed for good): label or delete them, as "
            "istio-cni's repair controller (off by default)", env="REPAIR_ENABLED",
            component="enrollment"),
    Setting("repair_label_pods", False, parse_bool, "repair by labelling the pod with "
            "repair_broken_pod_label_key=repair_broken_pod_label_value",
            env="REPAIR_LABEL_PODS", component="enrollment"),
    Setting("repair_delete_pods", False, parse_bool, "repair by deleting the pod (its "
            "controller recreates it; preconditions: same UID and resourceVersion)",
            env="REPAIR_DELETE_PODS", component="enrollment"),
    Setting("repair_broken_pod_label_key", "cni.istio.io/uninitialized", parse_str,
            "label key repair sets", env="REPAIR_BROKEN_POD_LABEL_KEY", component="enrollment"),
    Setting("repair_broken_pod_label_value", "true", parse_str, "label value repair sets",
            env="REPAIR_BROKEN_POD_LABEL_VALUE", component="enrollment"),
    # --- issue 27, what failed as written: replacing another istio-cni only when asked ---
    Setting("cni_force_install", False, parse_bool, "cni_manage_config: replace an istio-cni "
            "plugin or conflist entry that is not this agent's (upstream's, another agent's; "
            "without it the agent refuses to start, naming them)", component="cni"),
    # --- waypoints (issue 25): the file access log istiod configures from meshConfig ---
    Setting("waypoint_access_log_file", "", parse_str, "meshConfig accessLogFile for the "
            "waypoints this agent configures: the path Envoy writes its access log to "
            "(e.g. /dev/stdout); empty: no access log, istiod's default", component="xds"),
    Setting("waypoint_access_log_encoding", "text", choice("text", "json"), "meshConfig "
            "accessLogEncoding of the waypoints' access log", component="xds"),
    Setting("waypoint_access_log_format", "", parse_str, "meshConfig accessLogFormat of the "
            "waypoints' access log (text: an Envoy format string; json: a JSON object of "
            "field -> command); empty: istiod's default format", component="xds"),
    Setting("waypoint_status_write", True, parse_bool, "config_source kubernetes: write the "
            "status of istio-waypoint Gateways and of the routes attached to Services "
            "(Accepted, ResolvedRefs, Programmed, addresses) as istiod does, one agent at a "
            "time by Lease; steps aside while istiod's gateway status writer holds its lock",
            component="ambient"),
]

SETTINGS_BY_NAME = {s.name: s for s in SETTINGS}

# ``AMBIENT_AGENT_*`` variables that are not settings (an unknown one is refused): set by
# the agent on children it runs (cni/runtime_labels.py), never read by load().
NOT_SETTINGS = frozenset({"AMBIENT_AGENT_EVENTS_OWNER"})

# Settings that existed under another name: a config file or environment still using the
# old name gets a ConfigError saying what to use instead (never a silent default).
RENAMED = {
    "ca_tokens_file": "renamed to tokens_file (it now covers the xDS TLS port too)",
    "ca_client_cert_auth": "removed: every TLS port now verifies a client certificate when "
                           "one is presented and otherwise authenticates the bearer token",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config(Settings):
    """The effective configuration: one typed, read-only attribute per setting (declared
    in the generated :class:`agent.core.config_fields.Settings`) plus where each came from.

    ``origins[name]`` is one of ``"flag --x"``, ``"env NAME"``, ``"file PATH"``,
    ``"default"`` or ``"override"``. Neither the values nor ``origins`` can be changed
    after :func:`load`; :meth:`replace` makes a changed copy.
    """

    origins: Mapping[str, str]

    @property
    def values(self) -> dict[str, Any]:
        """``{setting name: value}`` in table order."""
        return {s.name: getattr(self, s.name) for s in SETTINGS}

    def replace(self, **changes: Any) -> "Config":
        """A copy with some values overridden (origin ``"override"``), not checked by the
        parsers; used by tests and the demo. Raises KeyError for an unknown setting."""
        for name in changes:
            if name not in SETTINGS_BY_NAME:
                raise KeyError(name)
        origins = {**self.origins, **{name: "override" for name in changes}}
        return dataclasses.replace(self, origins=types.MappingProxyType(origins), **changes)

    def as_dict(self) -> dict[str, dict[str, Any]]:
        """``{name: {"value": v, "source": origin}}``, JSON-friendly, for /debug and ``config``."""
        return {n: {"value": v, "source": self.origins[n]} for n, v in self.values.items()}


def _is_null_device(st: os.stat_result) -> bool:
    """Whether ``st`` is the null device's (``/dev/null``, every read empty)."""
    try:
        null = os.stat(os.devnull)
    except OSError:
        return False
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == null.st_rdev


def _read_config_file(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            # judged on the opened file (a symlink by its target), no race with a swap;
            # the null device (``--config-file /dev/null``: no file) holds nothing to trust
            st = os.fstat(f.fileno())
            problem = "" if _is_null_device(st) else trusted.public_file_problem(st)
            if problem:
                raise ConfigError("config_file", path, problem + ": it sets every setting")
            data = yamlsafe.load(f.read(), strict_keys=True)
    except FileNotFoundError:
        raise
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        # the parser's reason ("did not find expected key"): it names at most a character
        # of the file, never a value
        reason = getattr(e, "problem", None)
        why = (f": {e}" if isinstance(e, yamlsafe.TooLargeError)
               else f": {yamlsafe.short_text(str(reason), 200)}" if reason else "")
        raise ConfigError("config_file", path, f"malformed YAML{where}{why}") from None
    except UnicodeDecodeError as e:
        raise ConfigError("config_file", path, f"not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise ConfigError("config_file", path, e.strerror or str(e)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("config_file", path, "top level must be a mapping of setting: value")
    for name in sorted(set(data) & set(RENAMED)):
        raise ConfigError(name, data[name], f"{RENAMED[name]} (in {path})")
    unknown = sorted(set(data) - set(SETTINGS_BY_NAME))
    if unknown:
        close = closest(unknown[0], SETTINGS_BY_NAME)
        raise ConfigError(unknown[0], data[unknown[0]], f"unknown setting in {path}"
                          f"{f'; did you mean {close}?' if close else ''}")
    return data


def load(flags: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None) -> Config:
    """Resolve every setting.

    ``flags`` maps setting names to raw command-line strings (only those given);
    ``env`` defaults to ``os.environ``. Raises :class:`ConfigError` on the first bad value.
    """
    flags = dict(flags or {})
    env = os.environ if env is None else env
    for name, why in RENAMED.items():
        if "AMBIENT_AGENT_" + name.upper() in env:
            raise ConfigError(name, env["AMBIENT_AGENT_" + name.upper()], why,
                              "env AMBIENT_AGENT_" + name.upper())
    _check_env_names(env)
    raw: dict[str, tuple[Any, str]] = {}
    for s in SETTINGS:
        from_env = _from_env(s, env)
        if s.name in flags and flags[s.name] is not None:
            raw[s.name] = (flags[s.name], "flag " + s.flag)
        elif from_env is not None:
            raw[s.name] = from_env

    file_values: dict[str, Any] = {}
    file_origin = ""
    path_raw, path_origin = raw.get("config_file", (SETTINGS_BY_NAME["config_file"].default,
                                                     "default"))
    path = parse_path(path_raw)
    try:
        file_values = _read_config_file(path)
        file_origin = "file " + path
    except FileNotFoundError:
        if path_origin != "default":
            raise ConfigError("config_file", path, "file not found", path_origin) from None
    if "config_file" in file_values:  # it would be reported as the file read, and is not
        raise ConfigError("config_file", file_values["config_file"], "a config file cannot "
                          "name another one (give it with --config-file or "
                          "AMBIENT_AGENT_CONFIG_FILE)", file_origin)

    values: dict[str, Any] = {}
    origins: dict[str, str] = {}
    given: dict[str, Any] = {}  # raw values as written, for error messages
    for s in SETTINGS:
        if s.name in raw:
            value, origin = raw[s.name]
        elif s.name in file_values:
            value, origin = file_values[s.name], file_origin
        else:
            values[s.name] = s.default(values) if callable(s.default) else s.default
            origins[s.name] = "default"
            continue
        try:
            values[s.name] = s.parse(value)
        except (ValueError, TypeError) as e:
            raise ConfigError(s.name, value, str(e) or type(e).__name__, origin) from None
        origins[s.name], given[s.name] = origin, value
    _check_overridden(raw, env, file_values, file_origin)
    for name, reason in config_checks.problems(values, origins):
        origin = origins.get(name, "")
        raise ConfigError(name, given.get(name, values[name]), reason,
                          "" if origin == "default" else origin)
    return Config(**values, origins=types.MappingProxyType(origins))


def _from_env(s: Setting, env: Mapping[str, str]) -> tuple[str, str] | None:
    """``(value, origin)`` of setting ``s`` from its variable or its ``AMBIENT_AGENT_``
    alias, None when neither is set. Raises :class:`ConfigError` when both are set to
    different values (which one wins would be a guess)."""
    got = [(env[name], "env " + name) for name in (s.env_name, s.env_alias)
           if name and name in env]
    if len(got) == 2 and got[0][0] != got[1][0]:
        raise ConfigError(s.name, got[1][0], f"set twice, differently: {s.env_name}="
                          f"{got[0][0]!r} and {s.env_alias}={got[1][0]!r} (keep one)",
                          got[1][1])
    return got[0] if got else None


def _check_env_names(env: Mapping[str, str]) -> None:
    """Refuse an ``AMBIENT_AGENT_*`` variable that names no setting (a typo such as
    ``AMBIENT_AGENT_STATUS_PROT`` was ignored without a word, the setting left at its
    default), with the nearest real name. Istio's own names (``STATUS_PORT``) are not
    checked: unrelated processes share that namespace."""
    known = {n for s in SETTINGS for n in (s.env_name, s.env_alias) if n} | NOT_SETTINGS
    for name in sorted(env):
        if name.startswith("AMBIENT_AGENT_") and name not in known:
            setting = name[len("AMBIENT_AGENT_"):].lower()
            close = closest(setting, SETTINGS_BY_NAME)
            hint = f"; did you mean AMBIENT_AGENT_{close.upper()}?" if close else ""
            raise ConfigError(setting, env[name], "no such setting (unknown environment "
                              f"variable){hint}", "env " + name)


def closest(name: str, known: Iterable[str]) -> str | None:
    """The one of ``known`` closest to the mistyped ``name`` (a setting, a flag), if any
    is close enough to suggest."""
    import difflib
    close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.75)
    return close[0] if close else None


def _check_overridden(raw: Mapping[str, tuple[Any, str]], env: Mapping[str, str],
                      file_values: Mapping[str, Any], file_origin: str) -> None:
    """A value a higher source overrides must still parse: a bad environment variable or
    config-file key hidden by a flag is an operator's mistake waiting for the day the flag
    goes. Raises :class:`ConfigError` naming the setting, the value and its source."""
    for s in SETTINGS:
        if s.name not in raw:
            continue
        origin = raw[s.name][1]
        lower = []
        from_env = _from_env(s, env)
        if origin.startswith("flag ") and from_env is not None:
            lower.append(from_env)
        if s.name in file_values:
            lower.append((file_values[s.name], file_origin))
        for value, where in lower:
            try:
                s.parse(value)
            except (ValueError, TypeError) as e:
                raise ConfigError(s.name, value, f"{str(e) or type(e).__name__} (overridden "
                                  f"by {origin}, but fix or remove it)", where) from None


STATE_DIR_MODE = 0o711


def prepare_state_dir(config: Config) -> Path:
    """Create the state dir (mode 0711 when we create it) and check it is writable.

    0711: others may pass through it (not list it) to what is meant for them: the mesh
    root (``mesh-root/``, 0755/0644) and an SDS socket whose ``sds_socket_mode`` lets them
    in. Everything else in it has its own 0600 file or 0700 directory. A state dir of
    ours that is exactly 0700 (as earlier versions made it) is widened to 0711; any other
    mode is the operator's and kept.

    Refuses (:mod:`agent.core.trusted`) a state dir, or an existing ``ca_dir``, that is
    not owned by the agent's euid or is writable by group or others: its owner could swap
    the lock, sockets or CA files, or plant symlinks for root to write through.

    Raises :class:`ConfigError` naming ``state_dir`` (or ``ca_dir``) with the path, owner
    and mode, or when it can't be created or written.
    """
    path = Path(config.state_dir)
    origin = config.origins.get("state_dir", "")
    try:
        path.mkdir(mode=STATE_DIR_MODE, parents=True, exist_ok=True)
        problem = trusted.dir_problem(path)
        if problem:
            raise ConfigError("state_dir", str(path), problem + ": the agent keeps its lock, "
                              "sockets and keys there", origin)
        st = path.stat()
        if st.st_mode & 0o7777 == 0o700:
            os.chmod(path, STATE_DIR_MODE)
        ca_dir = Path(config.ca_dir)
        if ca_dir.exists():
            problem = trusted.dir_problem(ca_dir)
            if problem:
                raise ConfigError("ca_dir", str(ca_dir), problem + ": it holds the CA's key",
                                  config.origins.get("ca_dir", ""))
        # O_EXCL|O_NOFOLLOW: a planted symlink at the probe's name is refused, not followed
        probe = path / f".probe-{os.getpid()}"
        with contextlib.suppress(FileNotFoundError):
            probe.unlink()  # a stale one (same pid, a crashed run); unlink never follows
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600))
        probe.unlink()
    except OSError as e:
        raise ConfigError("state_dir", str(path), e.strerror or str(e), origin) from None
    return path


# The address setting each listener port binds to, so a bind failure caused by the
# address names the address setting rather than the port.
_ADDRESS_OF_PORT = {"xds_port": "xds_address", "xds_tls_port": "xds_tls_address",
                    "ca_port": "ca_listen_address", "status_port": "status_address",
                    "health_port": "status_address", "monitoring_port": "status_address"}


def tcp_listeners(config: "Config") -> list[tuple[str, str, int]]:
    """``(port setting, bind address, port)`` of every TCP port the agent listens on with
    ``config`` (port 0 = off is left out): status, health, plaintext xDS, TLS xDS + CA, the
    separate CA port."""
    listeners = [("status_port", config.status_address or "0.0.0.0", config.status_port),
                 ("health_port", config.status_address or "0.0.0.0", config.health_port),
                 ("monitoring_port", config.status_address or "0.0.0.0", config.monitoring_port),
                 ("xds_port", config.xds_address, config.xds_port),
                 ("xds_tls_port", config.xds_tls_address, config.xds_tls_port),
                 ("ca_port", config.ca_listen_address, config.ca_port)]
    return [entry for entry in listeners if entry[2]]


def ensure_ports_free(config: "Config") -> None:
    """Raise :class:`ConfigError` naming every busy port of :func:`tcp_listeners`, so the
    agent refuses to start before any component touched the node (host probe rules, CNI
    config) rather than after the earlier ones did."""
    from agent.core import portholders

    busy = []
    for setting, host, port in tcp_listeners(config):
        try:
            ensure_tcp_port_free(setting, host, port)
        except ConfigError as e:
            origin = config.origins.get(e.setting, "")
            held = portholders.describe(port) if e.setting == setting and port else ""
            busy.append(ConfigError(e.setting, e.value, e.reason + held,
                                    "" if origin == "default" else origin))
    distinct: dict[tuple[str, str], ConfigError] = {}
    for refused in busy:  # one address refused for three ports: said once
        distinct.setdefault((refused.setting, str(refused.value)), refused)
    busy = list(distinct.values())
    if len(busy) == 1:
        raise busy[0]
    if busy:
        raise ConfigError(busy[0].setting, busy[0].value, "; ".join(
            [busy[0].reason] + [str(e) for e in busy[1:]]))


def ensure_tcp_port_free(setting: str, host: str, port: int) -> None:
    """Raise :class:`ConfigError` if ``host:port`` can't be bound now.

    gRPC's own bind failure is a C-core log line plus a generic RuntimeError; checking
    first gives the operator one clear line. The error names the address setting
    (``xds_address`` for ``xds_port``, ...) when the address is the problem (not an IP,
    or not an address of this host: EADDRNOTAVAIL), else ``setting`` (port in use,
    permission denied). Port 0 (kernel's choice) checks only the address.
    """
    address_setting = _ADDRESS_OF_PORT.get(setting, setting)
    text = host.strip("[]")
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(text).version == 6 else socket.AF_INET
    except ValueError:
        if text:
            raise ConfigError(address_setting, host, "expected an IPv4 or IPv6 address to "
                              "bind") from None
        family = socket.AF_INET  # empty: all addresses
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((text, port))
        except OSError as e:
            if e.errno == errno.EADDRNOTAVAIL:
                raise ConfigError(address_setting, host, f"cannot listen on this address "
                                  f"(for {setting} {port}): not an address of this host"
                                  ) from None
            raise ConfigError(setting, port, f"cannot listen on port {port} of {host or '*'}: "
                              f"{e.strerror or e}") from None
