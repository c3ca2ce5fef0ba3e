"""The ``istio-cni`` CNI plugin: a stateless, chained shim that asks the node agent.

The container runtime execs this once per pod for every CNI command, so its start-up
time is on every pod's critical path. It and its two helpers (:mod:`cni.plugin_request`:
the environment, config, ``prevResult`` and the snapshot fallback; :mod:`cni.plugin_wire`:
JSON and HTTP/1.1) therefore import only ``sys`` and built-in or C modules of the
standard library (``posix``, ``time``, ``_json``, ``_socket``): the
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

Log lines: written to stderr (the runtime's log) and, at or above ``plugin_log_level``,
forwarded to the agent once the command's result is decided, as upstream's plugin tees
its log to the node agent: one ``POST /log`` on the same ``pluginevent.sock``, the body a
JSON array of JSON-encoded lines ``{"level", "time", "msg", "command", "container_id",
"pod"}``. A failed command's error is one of those lines, so the agent's log has the
reason. Bounded: at most :data:`LOG_LINES_MAX` lines of :data:`LOG_LINE_MAX` characters;
sent without waiting for an answer, within :data:`LOG_SEND_TIMEOUT` seconds; a failure
to send is ignored (the line is still on stderr).

Plugin config keys (Istio's): ``plugin_log_level``, ``cni_agent_run_dir``,
``ambient_enabled``, ``exclude_namespaces``, ``pod_namespace``, plus ours:
``ambient_default`` (bool, decides for pods the agent has no object for) and
``agent_timeout`` (seconds, default 5 like Istio's client, at most 3600). Unknown keys are ignored.
"""

import posix  # built in: os.environ without importing os
import sys

from cni.plugin_request import (ERR_AGENT_REFUSED, ERR_NOT_AVAILABLE, ERR_TRY_AGAIN, LATEST_VERSION,
                                LEVELS, SNAPSHOT_NAME, SUPPORTED_VERSIONS, CniError, check_version,
                                convert_result, fallback_decision, load_snapshot, parse_cni_args,
                                parse_config, plugin_settings, pod_ips, prev_result, read_env)
from cni.plugin_wire import http_request, json_dumps, post_nowait

SOCKET_NAME = "pluginevent.sock"
DEL_TIMEOUT = 2.0  # DEL is best effort: never hold a sandbox teardown for long
DRAINING_TEXT = "node agent is shutting down"  # the agent's 503 body while it stops
LOG_PATH = "/log"  # upstream's UDSLogPath, here on the event socket
LOG_LINES_MAX = 32  # lines forwarded per invocation; more are counted in one last line
LOG_LINE_MAX = 2048  # characters of one forwarded message
LOG_SEND_TIMEOUT = 0.25  # seconds: connect + write of the forwarded lines, never waited on


class Plugin:
    """One invocation: ``env`` (mapping), ``stdin`` (bytes), ``log`` (text stream)."""

    def __init__(self, env, stdin, log):
        self.env, self.stdin, self.log_stream = env, stdin, log
        self.level = LEVELS["info"]
        self.version = LATEST_VERSION
        self.forward = []  # log lines for the agent (JSON texts), at most LOG_LINES_MAX
        self.dropped = 0
        self.socket = ""  # the agent's event socket, once the config named it

    def log(self, level, msg):
        if LEVELS[level] >= self.level:
            self.log_stream.write("istio-cni %s: %s\n" % (level, msg))
            self._keep(level, msg)

    def _keep(self, level, msg):
        if len(self.forward) >= LOG_LINES_MAX:
            self.dropped += 1
            return
        import time
        now = time.time()
        line = {"level": "warn" if level == "warning" else level,
                "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now))
                + ".%03dZ" % (int(now * 1000) % 1000),
                "msg": msg[:LOG_LINE_MAX], "command": self.env.get("CNI_COMMAND", ""),
                "container_id": self.env.get("CNI_CONTAINERID", "")}
        try:
            args = parse_cni_args(self.env.get("CNI_ARGS", ""))
        except CniError:  # the command's own error says so
            args = {}
        if args.get("K8S_POD_NAME"):
            line["pod"] = "%s/%s" % (args.get("K8S_POD_NAMESPACE", ""), args["K8S_POD_NAME"])
        self.forward.append(json_dumps(line))

    def run(self):
        """Returns ``(exit code, stdout text)``; never raises for bad input. The log
        lines kept for the agent are sent before returning (:meth:`send_logs`)."""
        try:
            result = 0, self._dispatch()
        except CniError as e:
            error = {"cniVersion": self.version, "code": e.code, "msg": e.msg}
            if e.details:
                error["details"] = e.details
            if self.env.get("CNI_COMMAND") != "VERSION":
                self.log("error", "%s failed (code %d): %s"
                         % (self.env.get("CNI_COMMAND", "command"), e.code, e.msg))
            result = 1, json_dumps(error)
        self.send_logs()
        return result

    def send_logs(self):
        """Forward the kept lines to the agent: one ``POST /log``, not waited on. Never
        raises; without a socket (VERSION, unreadable config) or lines, sends nothing."""
        if not self.forward or not self.socket:
            return
        lines, self.forward = self.forward, []
        if self.dropped:
            lines.append(json_dumps({"level": "warn", "time": "", "msg": "%d more plugin log "
                                     "lines not forwarded" % self.dropped}))
        try:
            post_nowait(self.socket, LOG_PATH, json_dumps(lines).encode(), LOG_SEND_TIMEOUT)
        except (OSError, ValueError):
            pass  # the lines are on stderr; the agent may be down

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
        self.socket = self._socket_path(settings)
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
