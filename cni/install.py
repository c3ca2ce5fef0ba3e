"""Install ``istio-cni`` on a node: the plugin launcher and the chained conflist entry.

``ambient-agent cni install [--conf-dir DIR] [--bin-dir DIR] [--state-dir DIR] ...``
(flags: :data:`CLI_SETTINGS`) installs once and exits 0; ``ambient-agent cni uninstall``
removes what install added: the launcher, and our entry from the conflist (a converted
``.conf`` is restored). The restored file has the same JSON content as before install,
not necessarily the same bytes (keys sorted, 2-space indent, as every write here). The
agent does the same at start/stop when
``cni_manage_config`` is true, and repairs the chain in between (component
``cni-installer``, :mod:`cni.installwatch`). Behavior follows
Istio's installer (``docs/cni.md``); the conflist logic is in
:mod:`cni.conflist`.

The plugin binary is a POSIX ``sh`` launcher that answers ``CNI_COMMAND=VERSION`` itself
and otherwise ``exec``s a Python ``-I -S`` on :func:`cni.plugin.exit_main` (``-I -S``
skip ``site``, every ``.pth`` file and the environment; ``benchmarks/bench_cni.py``
measures it). Which Python:

- ``cni_plugin_bundle`` set (the image sets it): the standalone build of
  ``scripts/build-cni-plugin.py`` (Debian's interpreter + the plugin, needing only glibc
  on the node) is copied to ``<bin dir>/istio-cni.d/<id>/`` and the launcher
  (:func:`cni.install_plugin.bundle_launcher_text`) runs it from there, found relative to the launcher's
  own path, so it works on a node with no Python and nothing of the agent;
- empty (development, the demo, a host install): :func:`cni.install_plugin.launcher_text` runs this
  agent's own interpreter with its checkout on ``sys.path``.

Every file is written atomically (``<name>.tmp.<random>`` + rename, a build as one
directory rename) so a runtime never execs or reads half a file.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import sys
from typing import TYPE_CHECKING, Any, Mapping

from agent.core.files import write_atomic
from cni import conflist
from cni.install_plugin import BUNDLE_DIR, PLUGIN_NAME, PROJECT_ROOT, BundleError, \
    bundle_launcher_text, copy_bundle, launcher_text, read_bundle, read_file

if TYPE_CHECKING:  # the component and the context are needed by the daemon only
    from agent.core.config import Config
    from agent.core.lifecycle import AgentContext
    from cni.installwatch import CniInstallerComponent

log = logging.getLogger(__name__)

class NoPrimaryConfig(RuntimeError):
    """The CNI conf dir holds no valid network config to chain into (yet)."""


class ForeignInstall(conflist.ConflistError):
    """Another istio-cni (not this agent's) is installed; the message names it."""


@dataclasses.dataclass
class Installer:
    """Installs into ``conf_dir``/``bin_dir`` for an agent whose event socket lives in
    ``run_dir``. ``conf_name`` pins the primary conflist (empty: first valid by name).

    All methods block (file I/O): call them from a worker thread inside the agent.
    """

    conf_dir: str
    bin_dir: str
    run_dir: str
    conf_name: str = ""
    exclude_namespaces: list[str] = dataclasses.field(default_factory=list)
    log_level: str = "info"
    ambient_default: bool = False
    python: str = sys.executable
    project_root: str = PROJECT_ROOT
    plugin_bundle: str = ""  # a build of scripts/build-cni-plugin.py; empty: dev launcher
    force: bool = False  # replace another istio-cni (see :meth:`foreign`)
    # the agent's state dir: where install records conf_dir/bin_dir for `cleanup`
    # (:data:`RECORD_NAME`); empty: not recorded
    record_dir: str = ""

    @property
    def entry(self) -> dict:
        return conflist.plugin_entry(self.run_dir, self.exclude_namespaces, self.log_level,
                                     self.ambient_default)

    @property
    def binary_path(self) -> str:
        return os.path.join(self.bin_dir, PLUGIN_NAME)

    @property
    def bundle_root(self) -> str:
        return os.path.join(self.bin_dir, BUNDLE_DIR)

    def wanted_launcher(self) -> bytes:
        """The launcher bytes this installer writes. Raises :class:`BundleError`."""
        if self.plugin_bundle:
            return bundle_launcher_text(read_bundle(self.plugin_bundle)[0]).encode()
        return launcher_text(self.python, self.project_root).encode()

    def install_binary(self) -> bool:
        """Install the plugin; True if the launcher was (re)written.

        With ``plugin_bundle``: the build is copied to ``istio-cni.d/<id>/`` first (one
        directory rename, :func:`copy_bundle`), then the launcher pointing at it replaces
        the old one (temp file + rename), so a runtime exec'ing ``istio-cni`` at any
        moment runs either the old complete plugin or the new one. The build the old
        launcher pointed at is kept (an exec that read the old launcher may still start
        it); older ones are removed. Stale temp files and dirs of an interrupted install
        are removed. Raises :class:`BundleError`, OSError.
        """
        os.makedirs(self.bin_dir, mode=0o755, exist_ok=True)
        for name in os.listdir(self.bin_dir):
            if name.startswith(PLUGIN_NAME + ".tmp."):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.bin_dir, name))
        keep: set[str] = set()
        if self.plugin_bundle:
            bundle_id, _ = copy_bundle(self.plugin_bundle, self.bundle_root)
            keep = {bundle_id, *self._referenced_bundles()}
        text = self.wanted_launcher()
        written = False
        if not (read_file(self.binary_path) == text and os.access(self.binary_path, os.X_OK)):
            write_atomic(self.binary_path, text, 0o755)
            written = True
        if self.plugin_bundle:
            self._prune_bundles(keep)
        elif written:
            self._precompile()
        return written

    def _referenced_bundles(self) -> set[str]:
        """Bundle ids the installed launcher points at (none for a dev launcher)."""
        text = (read_file(self.binary_path) or b"").decode("utf-8", "replace")
        marker = f"/{BUNDLE_DIR}/"
        out = set()
        for part in text.split(marker)[1:]:
            out.add(part.split("/", 1)[0])
        return out

    def _prune_bundles(self, keep: set[str]) -> None:
        try:
            names = os.listdir(self.bundle_root)
        except FileNotFoundError:
            return
        for name in names:
            if name not in keep:
                shutil.rmtree(os.path.join(self.bundle_root, name), ignore_errors=True)

    def _precompile(self) -> None:
        """Compile the plugin module now so the first pod does not pay for it."""
        import py_compile
        try:
            for name in ("__init__.py", "plugin.py", "plugin_request.py", "plugin_wire.py"):
                py_compile.compile(os.path.join(self.project_root, "cni", name), doraise=True)
        except (OSError, py_compile.PyCompileError) as e:
            log.debug("could not precompile the plugin: %s", e)

    def install_config(self) -> tuple[str, bool]:
        """Chain our entry into the primary config. Returns ``(path written, changed)``.

        Raises :class:`NoPrimaryConfig` when there is no valid config (the message names
        each file considered and why it was rejected), and
        :class:`conflist.ConflistError` when the chosen file can't be chained into.
        """
        return self._write_config(self._plan_config())

    def _plan_config(self) -> tuple[str, bytes, bytes, int]:
        """``(primary path, its bytes, wanted bytes, mode)``; reads only. Raises like
        :meth:`install_config`."""
        primary = conflist.find_primary(self.conf_dir, self.conf_name)
        if primary is None:
            raise NoPrimaryConfig(conflist.explain_no_primary(self.conf_dir, self.conf_name))
        raw = read_file(primary)
        if raw is None:
            raise NoPrimaryConfig(f"{primary} vanished while installing")
        try:
            existing = json.loads(raw)
        except ValueError as e:
            raise conflist.ConflistError(f"{primary}: not JSON: {e}") from None
        try:
            wanted = conflist.insert(existing, self.entry)
        except conflist.ConflistError as e:
            raise conflist.ConflistError(f"{primary}: {e}") from None
        return primary, raw, conflist.dumps(wanted), os.stat(primary).st_mode & 0o777

    def _write_config(self, plan: tuple[str, bytes, bytes, int]) -> tuple[str, bool]:
        primary, raw, data, mode = plan
        target = primary[:-len(".conf")] + ".conflist" if primary.endswith(".conf") else primary
        if target == primary and raw == data:
            return primary, False
        write_atomic(target, data, mode)
        if target != primary:
            os.unlink(primary)  # the .conf became the .conflist next to it
        log.info("chained istio-cni into %s", target)
        return target, True

    def foreign(self) -> list[str]:
        """Why the ``istio-cni`` plugin or a conflist entry present is not this agent's
        (upstream's binary, another agent's entry), one line each; [] when none is."""
        from cni.cleanup import foreign

        try:
            return foreign(self)
        except OSError:  # unreadable (a directory in its place): install reports it
            return []

    def install(self) -> str:
        """Binary + config; returns the conflist path. The conf dir is checked first, so
        an install that raises (like :meth:`install_config`) has written nothing. Another
        istio-cni found there raises :class:`ForeignInstall` unless ``force``."""
        if not self.force:
            found = self.foreign()
            if found:
                raise ForeignInstall("; ".join(found) + ": refusing to replace another "
                                     "istio-cni (--force, or cni_force_install, replaces it)")
        plan = self._plan_config()
        self.install_binary()
        path = self._write_config(plan)[0]
        self._record()
        return path

    def _record(self) -> None:
        """Note in ``record_dir`` where this install went, so ``ambient-agent cleanup``
        finds it without being given the same ``--cni-conf-dir``/``--cni-bin-dir``. A
        failure is logged: the install itself stands."""
        if not self.record_dir:
            return
        path = os.path.join(self.record_dir, RECORD_NAME)
        entry = {"conf_dir": self.conf_dir, "bin_dir": self.bin_dir,
                 "conf_name": self.conf_name}
        try:
            kept = [e for e in read_records(self.record_dir) if e != entry]
            os.makedirs(self.record_dir, mode=0o711, exist_ok=True)
            write_atomic(path, json.dumps({"installs": kept + [entry]}, indent=1) + "\n")
        except OSError as e:
            log.warning("cannot record the CNI install in %s: %s (cleanup then needs "
                        "--cni-conf-dir %s --cni-bin-dir %s)", path, e.strerror or e,
                        self.conf_dir, self.bin_dir)

    def forget(self) -> None:
        """Drop this install's entry from the record (after an uninstall)."""
        if not self.record_dir:
            return
        path = os.path.join(self.record_dir, RECORD_NAME)
        mine = {"conf_dir": self.conf_dir, "bin_dir": self.bin_dir}
        kept = [e for e in read_records(self.record_dir)
                if {k: e.get(k) for k in mine} != mine]
        try:
            if kept:
                write_atomic(path, json.dumps({"installs": kept}, indent=1) + "\n")
            elif os.path.exists(path):
                os.unlink(path)
        except OSError as e:
            log.warning("cannot update %s: %s", path, e.strerror or e)

    def check(self) -> str | None:
        """Why the installation needs repair (one line), or None when it is intact."""
        try:
            wanted = self.wanted_launcher()
        except BundleError as e:
            return str(e)
        if read_file(self.binary_path) != wanted:
            return f"{self.binary_path} is missing or differs"
        if self.plugin_bundle:
            bundle_id = read_bundle(self.plugin_bundle)[0]
            if not os.path.isfile(os.path.join(self.bundle_root, bundle_id, "MANIFEST.json")):
                return f"{os.path.join(self.bundle_root, bundle_id)} is missing"
        primary = conflist.find_primary(self.conf_dir, self.conf_name)
        if primary is None:
            return conflist.explain_no_primary(self.conf_dir, self.conf_name)
        try:
            config = json.loads(read_file(primary) or b"")
        except ValueError:
            return f"{primary} is not JSON"
        problem = conflist.chain_problem(config, self.entry)
        return f"{primary}: {problem}" if problem else None

    def uninstall(self, dry_run: bool = False) -> list[str]:
        """Remove our entry from every config in ``conf_dir`` (restoring a converted
        ``.conf``) and the launcher. Returns what was done, one line each; ``dry_run``:
        what would be done, nothing changed."""
        done: list[str] = []
        try:
            names = sorted(os.listdir(self.conf_dir))
        except FileNotFoundError:
            names = []
        for name in names:
            if not name.endswith(".conflist"):
                continue
            path = os.path.join(self.conf_dir, name)
            raw = read_file(path)
            try:
                config = json.loads(raw or b"")
            except ValueError:
                continue
            if not conflist.is_conflist(config) or not any(
                    isinstance(p, dict) and p.get("type") == conflist.PLUGIN_TYPE
                    for p in config.get("plugins") or []):
                continue
            restored, as_conf = conflist.remove(config)
            mode = os.stat(path).st_mode & 0o777
            if dry_run:
                done.append(f"restore {path[:-len('.conflist')]}.conf (remove istio-cni from "
                            f"{path})" if as_conf else f"remove istio-cni from {path}")
            elif as_conf:
                conf_path = path[:-len(".conflist")] + ".conf"
                write_atomic(conf_path, conflist.dumps(restored), mode)
                os.unlink(path)
                done.append(f"restored {conf_path} (removed istio-cni from {path})")
            else:
                write_atomic(path, conflist.dumps(restored), mode)
                done.append(f"removed istio-cni from {path}")
        if os.path.exists(self.binary_path):
            if not dry_run:
                os.unlink(self.binary_path)
            done.append(f"{'remove' if dry_run else 'removed'} {self.binary_path}")
        if os.path.isdir(self.bundle_root):
            if not dry_run:
                shutil.rmtree(self.bundle_root)
            done.append(f"{'remove' if dry_run else 'removed'} {self.bundle_root}")
        if not dry_run:
            self.forget()
        return done


RECORD_NAME = "cni-install.json"


def read_records(state_dir: str) -> list[dict[str, str]]:
    """The installs recorded in ``<state_dir>/cni-install.json`` (each ``conf_dir``,
    ``bin_dir``, ``conf_name``; absolute paths); [] when there is none or it is damaged
    (logged)."""
    path = os.path.join(state_dir, RECORD_NAME)
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read(1 << 20))
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as e:
        log.warning("ignoring %s: %s", path, e)
        return []
    out = []
    for entry in (data.get("installs") if isinstance(data, dict) else None) or []:
        if (isinstance(entry, dict) and all(isinstance(entry.get(k), str) and
                                            os.path.isabs(entry[k])
                                            for k in ("conf_dir", "bin_dir"))):
            out.append({"conf_dir": entry["conf_dir"], "bin_dir": entry["bin_dir"],
                        "conf_name": str(entry.get("conf_name") or "")})
    return out


def installer_from_config(config: Config) -> Installer:
    """An :class:`Installer` from the agent's :class:`agent.core.config.Config`."""
    return Installer(conf_dir=config.cni_conf_dir, bin_dir=config.cni_bin_dir,
                     run_dir=os.path.dirname(config.cni_event_socket),
                     conf_name=config.cni_conf_name,
                     exclude_namespaces=list(config.exclude_namespaces),
                     plugin_bundle=config.cni_plugin_bundle,
                     force=config.cni_force_install, record_dir=config.state_dir)


# --- `ambient-agent cni install|uninstall` ---

# The settings install/uninstall read, and their flags (short names for the cni_* ones:
# the subcommand already says "cni"). state_dir and cni_event_socket give the conflist
# entry's cni_agent_run_dir; exclude_namespaces is written into the entry too.
CLI_SETTINGS = {
    "cni_conf_dir": "--conf-dir",
    "cni_bin_dir": "--bin-dir",
    "cni_conf_name": "--conf-name",
    "cni_plugin_bundle": "--plugin-bundle",
    "state_dir": "--state-dir",
    "cni_event_socket": "--cni-event-socket",
    "exclude_namespaces": "--exclude-namespaces",
    "config_file": "--config-file",
}
DERIVED_DEFAULTS = {"cni_event_socket": "<state-dir>/pluginevent.sock"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Registered in ``agent.cli.SUBCOMMANDS`` as ``cni``: ``install`` and ``uninstall``,
    each with only the flags of :data:`CLI_SETTINGS` (values stay raw strings until
    :func:`agent.core.config.load`; flag > env > config file > default, as for ``run``)."""
    from agent.core.config import SETTINGS_BY_NAME

    sub = parser.add_subparsers(dest="cni_command", metavar="ACTION", required=True)
    for action, text in (("install", "install the plugin and chain it into the primary "
                                     "conflist, then exit"),
                         ("uninstall", "remove the plugin and its conflist entry (the "
                                       "config keeps the same JSON content, reformatted)")):
        p = sub.add_parser(action, help=text, description=text)
        if action == "install":
            p.add_argument("--force", action="store_true",
                           help="replace an istio-cni plugin or conflist entry that is not "
                           "this agent's (refused otherwise, naming it)")
        group = p.add_argument_group("settings (flag > env > config file > default)")
        for name, flag in CLI_SETTINGS.items():
            s = SETTINGS_BY_NAME[name]
            default = DERIVED_DEFAULTS.get(name, s.default)
            if isinstance(default, (list, tuple)):
                default = ",".join(default)
            group.add_argument(flag, dest=name, default=None, metavar=s.metavar,
                               help=f"{s.help} [setting {name}, env {s.env_name}, default "
                               f"{default or 'empty'}]".replace("%", "%%"))


def config_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> Any:
    """The :class:`agent.core.config.Config` for install/uninstall: flags of
    :data:`CLI_SETTINGS`, then their env variables, then the config file. Environment
    variables of other settings are ignored (this command does not use them). Raises
    :class:`agent.core.config.ConfigError` naming the setting and the bad value."""
    from agent.core import config as agent_config

    environ: Mapping[str, str] = os.environ if env is None else env
    wanted = {agent_config.SETTINGS_BY_NAME[n].env_name for n in CLI_SETTINGS}
    flags = {name: getattr(args, name, None) for name in CLI_SETTINGS}
    return agent_config.load(flags, {k: v for k, v in environ.items() if k in wanted})


def main(args: argparse.Namespace) -> int:
    installer = installer_from_config(config_from_args(args))
    installer.force = installer.force or bool(getattr(args, "force", False))
    try:
        if args.cni_command == "install":
            # the agent's installer creates a missing bin dir (a fresh node's hostPath);
            # by hand it is more often a typo: said, as the runtime will not look there
            created = not os.path.isdir(installer.bin_dir)
            path = installer.install()
            if created:
                print(f"ambient-agent cni install: created --bin-dir {installer.bin_dir}, which "
                      "did not exist: the container runtime must run CNI plugins from there "
                      "(else pod sandboxes fail: plugin istio-cni not found)", file=sys.stderr)
            print(f"installed {installer.binary_path}; istio-cni chained into {path}")
        else:
            for line in installer.uninstall() or ["nothing to remove"]:
                print(line)
    except (NoPrimaryConfig, conflist.ConflistError, BundleError, OSError) as e:
        print(f"ambient-agent cni {args.cni_command}: {e}", file=sys.stderr)
        return 1
    return 0


def build(ctx: AgentContext) -> CniInstallerComponent | None:
    """Builder of the ``cni-installer`` component; None unless ``cni_manage_config``."""
    if not ctx.config.cni_manage_config:
        return None
    from cni.installwatch import CniInstallerComponent

    return CniInstallerComponent(ctx, installer_from_config(ctx.config))
