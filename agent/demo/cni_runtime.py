"""A small libcni: run a conflist's plugins on a netns the way a container runtime does.

Debian ships no ``cnitool`` (``docs/maintainers/testing.md``), so tests and the demo use this.
It follows the CNI spec 1.1.0 "Network configuration lists" execution rules, as
libcni does them:

- ADD: plugins in order; each gets the plugin object with the list's ``name`` and
  ``cniVersion`` injected, plus ``prevResult`` = the previous plugin's result
  (none for the first); the last result is the network's result and is cached
  (``<cache_dir>/<network>-<container id>-<ifname>.json``) like libcni's result cache.
- DEL: plugins in reverse order, each with the cached result as ``prevResult``; the
  cache entry is removed. CHECK: in order with the cached result.
- ``CNI_ARGS`` gets ``IgnoreUnknown=1`` first, as kubelet/CRI and podman send it.

Blocking (runs subprocesses): call from a worker thread inside async code.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from typing import Any


class CniPluginError(RuntimeError):
    """A plugin failed: ``plugin`` (type), ``code`` (CNI error code or None), ``msg``,
    ``details``, ``stderr``. ``str()`` names the plugin, the code and the message."""

    def __init__(self, plugin: str, code: int | None, msg: str, details: str = "",
                 stderr: str = ""):
        self.plugin, self.code, self.msg, self.details, self.stderr = (
            plugin, code, msg, details, stderr)
        super().__init__(f"CNI plugin {plugin} failed (code {code}): {msg}")


@dataclasses.dataclass
class CniRuntime:
    """``bin_dirs``: where plugin executables are looked up (``CNI_PATH``);
    ``cache_dir``: where ADD results are kept for DEL/CHECK; ``timeout``: per plugin (s)."""

    bin_dirs: list[str]
    cache_dir: str
    timeout: float = 30.0

    def find_plugin(self, plugin_type: str) -> str:
        for d in self.bin_dirs:
            path = os.path.join(d, plugin_type)
            if os.path.isfile(path) and os.access(path, os.X_OK):
                return path
        raise CniPluginError(plugin_type, None, f"plugin {plugin_type!r} not found in "
                             f"{':'.join(self.bin_dirs)}")

    def exec_plugin(self, command: str, plugin: dict, container_id: str, netns: str,
                    ifname: str, args: dict[str, str] | None = None) -> dict | None:
        """Run one plugin once; returns its parsed stdout (None when empty).
        Raises :class:`CniPluginError` when the plugin is missing, exits non-zero, prints
        unparsable output or runs longer than ``timeout`` seconds (it is then killed)."""
        plugin_type = plugin.get("type", "")
        cni_args = ";".join(["IgnoreUnknown=1"] + [f"{k}={v}" for k, v in (args or {}).items()])
        env = {
            "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
            "CNI_COMMAND": command, "CNI_CONTAINERID": container_id, "CNI_NETNS": netns,
            "CNI_IFNAME": ifname, "CNI_ARGS": cni_args, "CNI_PATH": ":".join(self.bin_dirs),
        }
        try:
            proc = subprocess.run([self.find_plugin(plugin_type)],
                                  input=json.dumps(plugin).encode(), capture_output=True,
                                  env=env, timeout=self.timeout)
        except subprocess.TimeoutExpired as e:
            raise CniPluginError(plugin_type, None, f"{command} did not finish within "
                                 f"{self.timeout:g}s",
                                 stderr=(e.stderr or b"").decode("utf-8", "replace")) from None
        out = proc.stdout.decode("utf-8", "replace").strip()
        stderr = proc.stderr.decode("utf-8", "replace")
        parsed: Any = None
        if out:
            try:
                parsed = json.loads(out)
            except ValueError:
                raise CniPluginError(plugin_type, None, f"unparsable output {out[:200]!r}",
                                     stderr=stderr) from None
        if proc.returncode != 0:
            if isinstance(parsed, dict) and "code" in parsed:
                raise CniPluginError(plugin_type, parsed.get("code"), parsed.get("msg", ""),
                                     parsed.get("details", ""), stderr)
            raise CniPluginError(plugin_type, None, f"exit {proc.returncode}: {out[:200]}",
                                 stderr=stderr)
        return parsed

    def _cache_path(self, network: str, container_id: str, ifname: str) -> str:
        return os.path.join(self.cache_dir, f"{network}-{container_id}-{ifname}.json")

    @staticmethod
    def _plugin_config(conflist: dict, plugin: dict, prev: dict | None) -> dict:
        config = dict(plugin)
        config["name"] = conflist["name"]
        config["cniVersion"] = conflist["cniVersion"]
        if prev is not None:
            config["prevResult"] = prev
        else:
            config.pop("prevResult", None)
        return config

    def add(self, conflist: dict, container_id: str, netns: str, ifname: str = "eth0",
            args: dict[str, str] | None = None) -> dict:
        """ADD the network; returns (and caches) the final result."""
        result: dict | None = None
        for plugin in conflist["plugins"]:
            result = self.exec_plugin("ADD", self._plugin_config(conflist, plugin, result),
                                      container_id, netns, ifname, args)
        os.makedirs(self.cache_dir, mode=0o700, exist_ok=True)
        with open(self._cache_path(conflist["name"], container_id, ifname), "w") as f:
            json.dump(result or {}, f)
        return result or {}

    def cached_result(self, conflist: dict, container_id: str, ifname: str = "eth0") -> dict | None:
        try:
            with open(self._cache_path(conflist["name"], container_id, ifname)) as f:
                return json.load(f)
        except FileNotFoundError:
            return None

    def check(self, conflist: dict, container_id: str, netns: str, ifname: str = "eth0",
              args: dict[str, str] | None = None) -> None:
        prev = self.cached_result(conflist, container_id, ifname)
        for plugin in conflist["plugins"]:
            self.exec_plugin("CHECK", self._plugin_config(conflist, plugin, prev),
                             container_id, netns, ifname, args)

    def delete(self, conflist: dict, container_id: str, netns: str, ifname: str = "eth0",
               args: dict[str, str] | None = None) -> None:
        """DEL in reverse order with the cached result; removes the cache entry."""
        prev = self.cached_result(conflist, container_id, ifname)
        for plugin in reversed(conflist["plugins"]):
            self.exec_plugin("DEL", self._plugin_config(conflist, plugin, prev),
                             container_id, netns, ifname, args)
        try:
            os.unlink(self._cache_path(conflist["name"], container_id, ifname))
        except FileNotFoundError:
            pass

    def status(self, conflist: dict) -> None:
        """STATUS (CNI 1.1.0) of every plugin; raises on the first unavailable one."""
        for plugin in conflist["plugins"]:
            self.exec_plugin("STATUS", self._plugin_config(conflist, plugin, None), "", "", "")


def load_conflist(path: str) -> dict:
    """Read a ``.conflist`` (or wrap a ``.conf`` as a one-plugin list, as libcni does)."""
    with open(path) as f:
        config = json.load(f)
    if "plugins" not in config:
        config = {"cniVersion": config.get("cniVersion", "0.3.1"), "name": config.get("name", ""),
                  "plugins": [config]}
    return config
