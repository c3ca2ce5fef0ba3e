"""The ``istio-cni`` CNI plugin: a stateless, chained shim that asks the node agent.

The container runtime execs this once per pod for every CNI command, so its start-up
time is on every pod's critical path. It therefore imports only ``sys`` and built-in or
C modules of the standard library (``posix``, ``time``, ``_json``, ``_socket``): the
pure-Python ``json``, ``socket`` and ``http.client`` modules pull in ``re``, ``enum``,
``email`` and ``ssl`` and cost ~30 ms per exec on our machines against a ~9 ms
interpreter start, and even ``os`` costs ~1 ms (``_collections_abc`` for
``os.environ``), measured in ``benchmarks/bench_cni.py``. It runs under
``python3 -I -S``, started by the launcher of :mod:`cni.install` (which answers
``VERSION`` itself, without Python).

Contract (CNI spec 1.1.0, "Plugin execution" and "Error codes"; Istio behavior from
``docs/cni.md``):

- ``CNI_COMMAND`` = ``ADD`` | ``DEL`` | ``CHECK`` | ``VERSION`` | ``STATUS`` | ``GC``;
  other ``CNI_*`` variables as the CNI spec requires per command; the network config
  (with ``prevResult``) on stdin. Versions 0.3.0 .. 1.1.0.
- ADD: POST a :class:`cni.events.CniPodEvent` JSON to
  ``<cni_agent_run_dir>/pluginevent.sock`` ``/cmdadd`` (HTTP/1.1 over AF_UNIX); the
  agent answers after the pod is enrolled (or decides it is not ambient). On success
  ``prevResult`` is printed unchanged, converted only where the config's
  ``cniVersion`` requires (the ``ips[].version`` field exists before 1.0.0 only).
- DEL: best effort, POST ``/cmddel``; always succeeds, also when the agent or the
  netns is gone. CHECK and GC: succeed (the agent reconciles). STATUS: ``GET /healthz``.
- Without an answer from the agent (socket missing or refused, timeout, unparsable
  answer, or the agent shutting down): :func:`fallback_decision` over the enablement
  snapshot the agent keeps next to its socket (``enablement.json``, see
  :mod:`cni.snapshot`): an ambient pod gets code 11 (the runtime retries the sandbox
  until an agent enrolls it), any other pod its ``prevResult`` (never blocked). No
  readable snapshot: code 11 (nothing is known, so nothing is let through unmeshed).
- Errors: a CNI error object on stdout, exit 1. Codes: 1 incompatible CNI version,
  4 missing/invalid ``CNI_*`` variable, 6 config not decodable, 7 invalid network
  config, 11 try again later (an ambient pod without an agent, an agent timeout or a
  retryable enrollment error), 50 STATUS with the agent unavailable, 999 the agent
  refused the pod (its reason is the message).

Plugin config keys (Istio's): ``plugin_log_level``, ``cni_agent_run_dir``,
``ambient_enabled``, ``exclude_namespaces``, ``pod_namespace``, plus ours:
``ambient_default`` (bool, decides for pods the agent has no object for) and
``agent_timeout`` (seconds, default 5 like Istio's client). Unknown keys are ignored.
"""

import posix  # built in: os.environ without importing os
import sys

try:  # the C accelerator of the stdlib json module, without json's `re` import
    import _json
except ImportError:  # pragma: no cover - non-CPython
    _json = None
import _socket

SUPPORTED_VERSIONS = ("0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0")
LATEST_VERSION = SUPPORTED_VERSIONS[-1]
DEFAULT_RUN_DIR = "/var/run/ambient-agent"
SOCKET_NAME = "pluginevent.sock"
DEFAULT_TIMEOUT = 5.0
DEL_TIMEOUT = 2.0  # DEL is best effort: never hold a sandbox teardown for long
SNAPSHOT_NAME = "enablement.json"  # written by the agent (cni/snapshot.py)
SNAPSHOT_VERSION = 1
SNAPSHOT_MAX_BYTES = 16 << 20  # ~100 k pods; anything larger is not ours
DRAINING_TEXT = "node agent is shutting down"  # the agent's 503 body while it stops

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


# --- JSON through the stdlib's C accelerator (same parser/encoder json.loads/dumps use) ---

class _ScanContext:
    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    memo = {}

    @staticmethod
    def parse_constant(name):
        raise ValueError("%s is not valid JSON" % name)


_WS = " \t\n\r"


def json_loads(text):
    """Parse one JSON document (str). Raises ValueError with the offset on bad input."""
    if _json is None:  # pragma: no cover
        import json
        return json.loads(text)
    start = len(text) - len(text.lstrip(_WS))
    try:
        value, end = _json.make_scanner(_ScanContext())(text, start)
    except (StopIteration, SystemError):
        # cold path: the C scanner can only build its error message once json.decoder
        # is imported (CPython 3.11), so let the json module explain the error
        import json
        json.loads(text)
        raise ValueError("malformed JSON") from None
    if text[end:].strip(_WS):
        raise ValueError("extra data at offset %d" % end)
    return value


def json_dumps(value):
    """Compact JSON text of dicts/lists/str/int/float/bool/None."""
    if _json is None:  # pragma: no cover
        import json
        return json.dumps(value, separators=(",", ":"))
    encode = _json.make_encoder(None, None, _json.encode_basestring_ascii, None, ":", ",",
                                False, False, True)
    return "".join(encode(value, 0))


# --- HTTP/1.1 over a Unix stream socket ---

def http_request(socket_path, method, path, body=b"", timeout=DEFAULT_TIMEOUT):
    """One HTTP/1.1 request with ``Connection: close``; returns ``(status, body bytes)``.

    ``timeout`` (seconds) bounds the whole exchange. Raises ``OSError`` (socket missing,
    refused), ``TimeoutError`` or ``ValueError`` (unparsable response). Written on
    ``_socket`` because ``http.client`` alone costs ~20 ms of imports per pod.
    """
    import time
    deadline = time.monotonic() + timeout
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(socket_path)
        head = ("%s %s HTTP/1.1\r\nHost: localhost\r\nUser-Agent: istio-cni\r\n"
                "Content-Type: application/json\r\nContent-Length: %d\r\n"
                "Connection: close\r\n\r\n" % (method, path, len(body)))
        sock.sendall(head.encode("ascii") + body)
        chunks = []
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("timed out")
            sock.settimeout(left)
            data = sock.recv(65536)
            if not data:
                break
            chunks.append(data)
            status, payload = _parse_response(b"".join(chunks))
            if status is not None:
                return status, payload
    finally:
        sock.close()
    status, payload = _parse_response(b"".join(chunks), eof=True)
    if status is None:
        raise ValueError("incomplete HTTP response from the agent")
    return status, payload


def _parse_response(raw, eof=False):
    """``(status, body)`` once the response is complete, else ``(None, None)``."""
    head, sep, rest = raw.partition(b"\r\n\r\n")
    if not sep:
        if eof:
            raise ValueError("malformed HTTP response from the agent")
        return None, None
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise ValueError("malformed HTTP status line %r" % lines[0][:80])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if "chunked" in headers.get("transfer-encoding", "").lower():
        body = _dechunk(rest)
        return (int(parts[1]), body) if body is not None else (None, None)
    length = headers.get("content-length")
    if length is not None and length.isdigit():
        if len(rest) >= int(length):
            return int(parts[1]), rest[:int(length)]
        return None, None
    return (int(parts[1]), rest) if eof else (None, None)


def _dechunk(data):
    out, pos = [], 0
    while True:
        line_end = data.find(b"\r\n", pos)
        if line_end < 0:
            return None
        size = int(data[pos:line_end].split(b";")[0] or b"0", 16)
        if size == 0:
            return b"".join(out)
        start = line_end + 2
        if len(data) < start + size + 2:
            return None
        out.append(data[start:start + size])
        pos = start + size + 2


# --- request parsing ---

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
    if settings["timeout"] <= 0:
        raise CniError(ERR_INVALID_CONFIG, "invalid network config: agent_timeout must be > 0, "
                       "got %r" % settings["timeout"])
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


# --- deciding without the agent ---

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
    namespaces = snap.get("namespaces") or {}
    if namespace and namespace in namespaces:
        return namespaces[namespace], "pod not known yet; namespace %s is %s" % (
            namespace, "ambient" if namespaces[namespace] else "not ambient")
    if ambient_default:
        return True, "pod not known; plugin config ambient_default is true"
    return False, "pod not known; plugin config ambient_default is not true"


# --- the commands ---

class Plugin:
    """One invocation: ``env`` (mapping), ``stdin`` (bytes), ``log`` (text stream)."""

    def __init__(self, env, stdin, log):
        self.env, self.stdin, self.log_stream = env, stdin, log
        self.level = LEVELS["info"]
        self.version = LATEST_VERSION

    def log(self, level, msg):
        if LEVELS[level] >= self.level:
            self.log_stream.write("istio-cni %s: %s\n" % (level, msg))

    def run(self):
        """Returns ``(exit code, stdout text)``; never raises for bad input."""
        try:
            return 0, self._dispatch()
        except CniError as e:
            error = {"cniVersion": self.version, "code": e.code, "msg": e.msg}
            if e.details:
                error["details"] = e.details
            return 1, json_dumps(error)

    def _dispatch(self):
        command = read_env(self.env)
        if command == "VERSION":
            return self._version()
        conf = parse_config(self.stdin)
        # a supported version is the error's version too, also when check_version refuses
        # the command for it (e.g. STATUS in a 1.0.0 config)
        if isinstance(conf.get("cniVersion"), str) and conf["cniVersion"] in SUPPORTED_VERSIONS:
            self.version = conf["cniVersion"]
        self.version = check_version(conf, command)
        settings = plugin_settings(conf)
        self.level = LEVELS[settings["log_level"].lower()]
        args = parse_cni_args(self.env.get("CNI_ARGS", ""))
        return getattr(self, "_" + command.lower())(conf, settings, args)

    def _version(self):
        requested = LATEST_VERSION
        if self.stdin.strip():
            conf = parse_config(self.stdin)
            if isinstance(conf.get("cniVersion"), str) and conf["cniVersion"]:
                requested = conf["cniVersion"]
        return json_dumps({"cniVersion": requested, "supportedVersions": list(SUPPORTED_VERSIONS)})

    def _event(self, command, settings, args, prev):
        event = {
            "command": command,
            "container_id": self.env["CNI_CONTAINERID"],
            "netns": self.env.get("CNI_NETNS", ""),
            "ifname": self.env.get("CNI_IFNAME", "eth0"),
            "pod_name": args.get("K8S_POD_NAME", ""),
            "pod_namespace": args.get("K8S_POD_NAMESPACE", ""),
            "pod_uid": args.get("K8S_POD_UID", ""),
            "ips": pod_ips(prev),
            "timeout": settings["timeout"],  # the agent answers within it, naming why
        }
        if settings["ambient_default"] is not None:
            event["ambient_default"] = settings["ambient_default"]
        return event

    def _skipped(self, settings, args):
        """Why this pod needs no agent call (ambient disabled, or a pod with an Istio sidecar, as
        upstream's ``cni/pkg/plugin/plugin.go`` skips them), or ``""``."""
        if not settings["ambient_enabled"]:
            return "ambient_enabled is false"
        namespace, name = args.get("K8S_POD_NAMESPACE", ""), args.get("K8S_POD_NAME", "")
        if namespace and namespace in settings["exclude_namespaces"]:
            return "namespace %s is excluded" % namespace
        if (settings["pod_namespace"] and namespace == settings["pod_namespace"]
                and name.startswith("istio-cni-node-")):
            return "the node agent's own pod"
        return ""

    def _socket_path(self, settings):
        return settings["run_dir"].rstrip("/") + "/" + SOCKET_NAME

    def _add(self, conf, settings, args):
        prev = prev_result(conf, required=True)
        skipped = self._skipped(settings, args)
        if skipped:
            self.log("debug", "ADD %s: not asking the agent: %s"
                     % (self.env["CNI_CONTAINERID"], skipped))
            return json_dumps(convert_result(prev, self.version))
        event = self._event("ADD", settings, args, prev)
        path = self._socket_path(settings)
        try:
            status, body = http_request(path, "POST", "/cmdadd", json_dumps(event).encode(),
                                        settings["timeout"])
        except TimeoutError:
            return self._without_agent(prev, settings, args, "node agent at %s did not answer "
                                       "within %gs" % (path, settings["timeout"]))
        except (OSError, ValueError) as e:
            return self._without_agent(prev, settings, args, "cannot reach the node agent at "
                                       "%s: %s" % (path, e))
        if status == 503 and body.startswith(DRAINING_TEXT.encode()):
            return self._without_agent(prev, settings, args, "node agent at %s is shutting "
                                       "down" % path)
        if status != 200:
            reason = body.decode("utf-8", "replace").strip()[:4096]
            code = ERR_TRY_AGAIN if status == 503 else ERR_AGENT_REFUSED
            raise CniError(code, "istio-cni cmdAdd: node agent refused pod (status %d): %s"
                           % (status, reason))
        self.log("debug", "ADD %s: agent answered %s" % (event["container_id"], body[:200]))
        return json_dumps(convert_result(prev, self.version))

    def _without_agent(self, prev, settings, args, problem):
        """No answer from the agent (``problem`` says why): decide from its snapshot
        (:func:`fallback_decision`). Returns the result for a pod that is not ambient;
        raises code 11 for an ambient one, and when there is no usable snapshot."""
        snap_path = settings["run_dir"].rstrip("/") + "/" + SNAPSHOT_NAME
        snap, why = load_snapshot(snap_path)
        container = self.env["CNI_CONTAINERID"]
        if snap is None:
            raise CniError(ERR_TRY_AGAIN, "istio-cni cmdAdd: %s, and no usable enablement "
                           "snapshot to decide without it (%s); try again later"
                           % (problem, why))
        namespace = args.get("K8S_POD_NAMESPACE", "")
        pod = "%s/%s" % (namespace, args.get("K8S_POD_NAME", "")) if namespace else container
        ambient, reason = fallback_decision(
            snap, namespace, args.get("K8S_POD_UID", "") or container,
            settings["ambient_default"], settings["exclude_namespaces"])
        if ambient:
            raise CniError(ERR_TRY_AGAIN, "istio-cni cmdAdd: %s; pod %s is ambient (%s), so "
                           "it must wait for the agent to enroll it; try again later"
                           % (problem, pod, reason))
        self.log("info", "ADD %s: %s; pod %s is not ambient (%s): let through"
                 % (container, problem, pod, reason))
        return json_dumps(convert_result(prev, self.version))

    def _del(self, conf, settings, args):
        prev = None
        try:
            prev = prev_result(conf, required=False)
        except CniError as e:  # DEL is best effort: a bad prevResult only loses the IPs
            self.log("warn", "DEL: ignoring prevResult: %s" % e.msg)
        if self._skipped(settings, args):
            return ""
        event = self._event("DEL", settings, args, prev)
        try:
            status, body = http_request(self._socket_path(settings), "POST", "/cmddel",
                                        json_dumps(event).encode(),
                                        min(settings["timeout"], DEL_TIMEOUT))
            if status != 200:
                self.log("warn", "DEL %s: agent answered %d: %s"
                         % (event["container_id"], status, body[:500]))
        except (OSError, ValueError) as e:
            self.log("warn", "DEL %s: agent not reached (%s); it reconciles later"
                     % (event["container_id"], e))
        return ""

    def _check(self, conf, settings, args):
        prev_result(conf, required=True)
        return ""

    def _gc(self, conf, settings, args):
        return ""  # the agent's reconciler owns pod state; nothing is cached here

    def _status(self, conf, settings, args):
        if not settings["ambient_enabled"]:
            return ""
        path = self._socket_path(settings)
        try:
            status, body = http_request(path, "GET", "/healthz", b"",
                                        min(settings["timeout"], DEL_TIMEOUT))
        except (OSError, ValueError) as e:
            raise CniError(ERR_NOT_AVAILABLE, "istio-cni: node agent at %s is not available: %s"
                           % (path, e)) from None
        if status != 200:
            raise CniError(ERR_NOT_AVAILABLE, "istio-cni: node agent at %s is not ready (status "
                           "%d): %s" % (path, status, body[:500].decode("utf-8", "replace")))
        return ""


def process_env():
    """The process environment as a ``str`` dict, decoded like ``os.environ`` does."""
    return {k.decode("utf-8", "surrogateescape"): v.decode("utf-8", "surrogateescape")
            for k, v in posix.environ.items()}


def main(argv=None, env=None):
    """Entry point (console script ``istio-cni``). Returns the process exit code; the
    result goes to ``sys.stdout``, flushed by the caller (:func:`exit_main`) or at exit.

    ``argv``: arguments after the program name (default ``sys.argv[1:]``); ``env``: the
    ``CNI_*`` environment (default: this process's).
    """
    if argv is None:
        argv = sys.argv[1:]
    if env is None:
        env = process_env()
    if argv and argv[0] in ("-h", "--help", "--version", "version"):
        sys.stdout.write("CNI plugin istio-cni (ambient node agent) supporting CNI %s\n"
                         % ", ".join(SUPPORTED_VERSIONS))
        return 0
    stdin = b"" if env.get("CNI_COMMAND") == "VERSION" and sys.stdin.isatty() \
        else sys.stdin.buffer.read()
    code, out = Plugin(env, stdin, sys.stderr).run()
    if out:
        sys.stdout.write(out + "\n")
    return code


def exit_main():
    """The launcher's entry: :func:`main`, flush, then ``posix._exit`` with its code.

    Skipping the interpreter's finalization (module teardown, GC) saves ~1.5 ms per
    exec, more than all our imports cost; nothing of the plugin needs it (the socket is
    closed, no files are open) once stdout and stderr are flushed. A flush that fails
    exits 120, like CPython does when flushing at exit fails. Never returns.
    """
    code = main()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError) as e:
        code = 120
        try:
            posix.write(2, ("istio-cni: cannot write the result: %s\n" % e).encode())
        except OSError:
            pass
    posix._exit(code)


if __name__ == "__main__":
    exit_main()
