"""What an ``istio-cni`` invocation asks (:mod:`cni.plugin`), checked: the ``CNI_*``
environment, the network config on stdin, the plugin's own keys, ``prevResult`` and the
result printed for it; and the decision taken without the agent, from its enablement
snapshot (:mod:`cni.snapshot` writes it).

CNI spec 1.1.0 ("Parameters", "Error codes", "Version considerations"). Every check
raises :class:`CniError` with the CNI error code and a message naming the variable or
key and the value. Stdlib-only, like the rest of the plugin's start-up path.
"""

import sys

from cni.plugin_wire import DEFAULT_TIMEOUT, MAX_TIMEOUT, json_dumps, json_loads

SUPPORTED_VERSIONS = ("0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0")
LATEST_VERSION = SUPPORTED_VERSIONS[-1]
DEFAULT_RUN_DIR = "/var/run/ambient-agent"
SNAPSHOT_NAME = "enablement.json"  # written by the agent (cni/snapshot.py)
SNAPSHOT_VERSION = 1
SNAPSHOT_MAX_BYTES = 16 << 20  # ~100 k pods; anything larger is not ours

# CNI spec error codes
ERR_INCOMPATIBLE_VERSION = 1
ERR_INVALID_ENV = 4
ERR_DECODE = 6
ERR_INVALID_CONFIG = 7
ERR_TRY_AGAIN = 11
ERR_NOT_AVAILABLE = 50
ERR_AGENT_REFUSED = 999  # what Istio's plugin gives (Go skel maps plain errors to 999)

COMMANDS = ("ADD", "DEL", "CHECK", "VERSION", "STATUS", "GC")
# CNI spec "Parameters": which variables each command needs besides CNI_COMMAND
REQUIRED_ENV = {
    "ADD": ("CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME", "CNI_PATH"),
    "CHECK": ("CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME", "CNI_PATH"),
    "DEL": ("CNI_CONTAINERID", "CNI_IFNAME", "CNI_PATH"),
    "STATUS": ("CNI_PATH",),
    "GC": ("CNI_PATH",),
    "VERSION": (),
}
LEVELS = {"debug": 10, "info": 20, "warn": 30, "warning": 30, "error": 40, "none": 100}


class CniError(Exception):
    """A CNI error result: ``code`` (CNI spec), ``msg`` (one line), ``details``."""

    def __init__(self, code, msg, details=""):
        super().__init__(msg)
        self.code, self.msg, self.details = code, msg, details


def version_tuple(version):
    try:
        return tuple(int(p) for p in version.split("."))
    except (AttributeError, ValueError):
        return ()


def parse_cni_args(text):
    """``K=V;K=V`` (CNI_ARGS) -> dict. Raises CniError(4) on a pair without ``=``."""
    args = {}
    for pair in (text or "").split(";"):
        if not pair:
            continue
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise CniError(ERR_INVALID_ENV, "invalid CNI_ARGS pair %r: expected KEY=VALUE" % pair)
        args[key] = value
    return args


def read_env(env):
    """Validate the ``CNI_*`` variables for the command; returns the command name."""
    command = env.get("CNI_COMMAND", "")
    if not command:
        raise CniError(ERR_INVALID_ENV, "missing environment variable CNI_COMMAND")
    if command not in COMMANDS:
        raise CniError(ERR_INVALID_ENV, "invalid CNI_COMMAND %r: expected one of %s"
                       % (command, ", ".join(COMMANDS)))
    for name in REQUIRED_ENV[command]:
        if not env.get(name):
            raise CniError(ERR_INVALID_ENV, "missing environment variable %s for %s"
                           % (name, command))
    ifname = env.get("CNI_IFNAME", "")
    if ifname and (len(ifname) > 15 or "/" in ifname or ":" in ifname or ifname in (".", "..")
                   or any(c.isspace() for c in ifname)):
        raise CniError(ERR_INVALID_ENV, "invalid CNI_IFNAME %r" % ifname)
    return command


def parse_config(raw):
    """stdin bytes -> network config dict. Raises CniError 6 (not UTF-8, not JSON, or
    nested past the recursion limit) or 7 (not an object)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CniError(ERR_DECODE, "network config is not UTF-8: %s" % e) from None
    if not text.strip():
        raise CniError(ERR_DECODE, "empty network config on stdin")
    try:
        conf = json_loads(text)
    except ValueError as e:
        raise CniError(ERR_DECODE, "cannot decode network config: %s" % e) from None
    except RecursionError:
        # the C scanner recurses per nesting level and gives up at the interpreter's
        # recursion limit (~1000): e.g. '[' * 100000 on stdin
        raise CniError(ERR_DECODE, "cannot decode network config: nested too deeply "
                       "(recursion limit %d)" % sys.getrecursionlimit()) from None
    if not isinstance(conf, dict):
        raise CniError(ERR_INVALID_CONFIG, "network config must be a JSON object, got %s"
                       % type(conf).__name__)
    return conf


def check_version(conf, command):
    version = conf.get("cniVersion")
    if not isinstance(version, str) or not version:
        raise CniError(ERR_INCOMPATIBLE_VERSION, "network config has no cniVersion (means 0.1.0);"
                       " supported: %s" % ", ".join(SUPPORTED_VERSIONS))
    if version not in SUPPORTED_VERSIONS:
        raise CniError(ERR_INCOMPATIBLE_VERSION, "incompatible CNI version %r; supported: %s"
                       % (version, ", ".join(SUPPORTED_VERSIONS)))
    needs = {"CHECK": "0.4.0", "STATUS": "1.1.0", "GC": "1.1.0"}.get(command)
    if needs and version_tuple(version) < version_tuple(needs):
        raise CniError(ERR_INCOMPATIBLE_VERSION, "config version %s does not allow %s (needs %s+)"
                       % (version, command, needs))
    return version


def plugin_settings(conf):
    """Our keys of the network config, type-checked. Raises CniError(7) naming the key."""
    def typed(key, kinds, default, what):
        value = conf.get(key, default)
        if value is None:
            return default
        if not isinstance(value, kinds) or (kinds is not bool and isinstance(value, bool)):
            raise CniError(ERR_INVALID_CONFIG, "invalid network config: %s must be %s, got %s"
                           % (key, what, json_dumps(value)))
        return value

    settings = {
        "log_level": typed("plugin_log_level", str, "info", "a string"),
        "run_dir": typed("cni_agent_run_dir", str, DEFAULT_RUN_DIR, "a string"),
        "ambient_enabled": typed("ambient_enabled", bool, True, "a boolean"),
        "ambient_default": typed("ambient_default", bool, None, "a boolean"),
        "exclude_namespaces": typed("exclude_namespaces", list, [], "a list of strings"),
        "pod_namespace": typed("pod_namespace", str, "", "a string"),
        "timeout": typed("agent_timeout", (int, float), DEFAULT_TIMEOUT, "a number of seconds"),
    }
    if not all(isinstance(n, str) for n in settings["exclude_namespaces"]):
        raise CniError(ERR_INVALID_CONFIG, "invalid network config: exclude_namespaces must be "
                       "a list of strings, got %s" % json_dumps(settings["exclude_namespaces"]))
    if not settings["run_dir"].startswith("/"):
        raise CniError(ERR_INVALID_CONFIG, "invalid network config: cni_agent_run_dir must be an "
                       "absolute path, got %r" % settings["run_dir"])
    # not (0 < t <= max) also refuses NaN; past the max, socket timeouts overflow time_t
    if not 0 < settings["timeout"] <= MAX_TIMEOUT:
        raise CniError(ERR_INVALID_CONFIG, "invalid network config: agent_timeout must be > 0 "
                       "and at most %d seconds, got %r" % (MAX_TIMEOUT, settings["timeout"]))
    if settings["log_level"].lower() not in LEVELS:
        raise CniError(ERR_INVALID_CONFIG, "invalid network config: plugin_log_level must be one "
                       "of debug, info, warn, error, none; got %r" % settings["log_level"])
    return settings


def prev_result(conf, required):
    """``prevResult`` as a dict (None if absent and not required). Raises CniError(7)."""
    prev = conf.get("prevResult")
    if prev is None:
        if required:
            raise CniError(ERR_INVALID_CONFIG, "invalid network config: missing prevResult; "
                           "istio-cni must be chained after an interface plugin")
        return None
    if not isinstance(prev, dict):
        raise CniError(ERR_INVALID_CONFIG, "invalid network config: prevResult must be an "
                       "object, got %s" % json_dumps(prev)[:100])
    ips = prev.get("ips", [])
    if ips is None:
        ips = []
    if not isinstance(ips, list) or not all(
            isinstance(ip, dict) and isinstance(ip.get("address"), str) for ip in ips):
        raise CniError(ERR_INVALID_CONFIG, "invalid network config: prevResult.ips must be a list"
                       " of {address: CIDR}, got %s" % json_dumps(ips)[:200])
    return prev


def pod_ips(prev):
    """Addresses without prefix length, from ``prevResult.ips``."""
    return [ip["address"].split("/")[0] for ip in (prev or {}).get("ips") or []]


def convert_result(prev, version):
    """``prevResult`` re-labelled as ``version``; ``ips[].version`` exists only before 1.0.0.

    The result types 0.3.x/0.4.0 and 1.x differ only there (CNI spec "Version
    considerations"), so that is the only conversion done; all other keys are kept.
    """
    out = dict(prev)
    out["cniVersion"] = version
    if prev.get("cniVersion") == version or not isinstance(prev.get("ips"), list):
        return out
    legacy = version_tuple(version) < (1, 0, 0)
    ips = []
    for ip in prev["ips"]:
        ip = dict(ip)
        if legacy:
            ip.setdefault("version", "6" if ":" in ip["address"] else "4")
        else:
            ip.pop("version", None)
        ips.append(ip)
    out["ips"] = ips
    return out


# deciding without the agent

def load_snapshot(path):
    """The agent's enablement snapshot at ``path``: ``(snapshot dict, "")``, or
    ``(None, why)`` when it is missing or unusable. Only its shape is checked (version 1, ``pods`` and ``namespaces``
    mapping names to booleans, ``excluded_namespaces`` a list of strings); anything else
    is unusable, never guessed at."""
    try:
        with open(path, "rb") as f:
            raw = f.read(SNAPSHOT_MAX_BYTES + 1)
    except OSError as e:
        return None, "cannot read %s: %s" % (path, e.strerror or e)
    if len(raw) > SNAPSHOT_MAX_BYTES:
        return None, "%s is larger than %d bytes" % (path, SNAPSHOT_MAX_BYTES)
    try:
        snap = json_loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        return None, "%s is not valid JSON: %s" % (path, e)
    if not isinstance(snap, dict) or snap.get("version") != SNAPSHOT_VERSION:
        return None, "%s: field 'version' must be %d, got %s" % (
            path, SNAPSHOT_VERSION, json_dumps(snap.get("version")
                                              if isinstance(snap, dict) else snap)[:40])
    for field in ("pods", "namespaces"):
        value = snap.get(field)
        if not isinstance(value, dict) or not all(
                isinstance(k, str) and isinstance(v, bool) for k, v in value.items()):
            return None, "%s: field %r must map names to booleans" % (path, field)
    excluded = snap.get("excluded_namespaces")
    if not isinstance(excluded, list) or not all(isinstance(n, str) for n in excluded):
        return None, "%s: field 'excluded_namespaces' must be a list of strings" % path
    return snap, ""


def fallback_decision(snap, namespace, key, ambient_default, exclude_namespaces=()):
    """Would the agent enroll this pod? ``(ambient, reason)`` from the snapshot alone.

    ``namespace`` is ``K8S_POD_NAMESPACE`` (empty without Kubernetes), ``key`` the pod
    UID or, without one, the container ID (how the agent names the pod). In order: an
    excluded namespace is never ambient; a pod the snapshot knows gets the agent's last
    answer for it; a pod it does not know (created while no agent ran) gets its
    namespace's answer for a pod without a ``istio.io/dataplane-mode`` label of its own;
    with no known namespace (or no namespace at all) the plugin config's
    ``ambient_default`` decides, as the agent does for a pod it has no object for. A new
    pod whose own label disagrees with its namespace is therefore decided by the
    namespace; the agent corrects that at its start (it enrolls running ambient pods,
    and removes pods that are not)."""
    excluded = set(snap.get("excluded_namespaces") or ()) | set(exclude_namespaces or ())
    if namespace and namespace in excluded:
        return False, "namespace %s is excluded" % namespace
    pods = snap.get("pods") or {}
    if key in pods:
        return pods[key], "the agent's last decision for this pod"
    if not namespace and snap.get("registration"):
        # a container the agent registers itself (podman): only it can read its labels
        return True, ("container not known; the agent registers this runtime's "
                      "containers from their labels (%s), which it must read first"
                      % snap.get("registration"))
    namespaces = snap.get("namespaces") or {}
    if namespace and namespace in namespaces:
        return namespaces[namespace], "pod not known yet; namespace %s is %s" % (
            namespace, "ambient" if namespaces[namespace] else "not ambient")
    if ambient_default:
        return True, "pod not known; plugin config ambient_default is true"
    return False, "pod not known; plugin config ambient_default is not true"


