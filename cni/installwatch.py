"""The ``cni-installer`` component: install at start, keep the chain intact while running.

Istio's loop (``docs/cni.md``): install, then forever watch the CNI conf dir
and the bin dir; on any change re-check and reinstall when the primary CNI rewrote
its file without us (or removed our launcher). A throttle (at most one repair per
``REPAIR_INTERVAL`` seconds after ``BURST`` quick ones) doubles as Istio's loop
detector: another component that keeps reverting the file gets a warning, not a
busy loop. ``watchfiles`` watches directories, so a file replaced by rename (how CNIs
write) is seen, unlike a per-file fsnotify watch.

When there is no primary config yet (the node's CNI starts after us), the component
is not ready and installs as soon as one appears.

At stop the plugin stays: the launcher and our conflist entry are left in place, so a
pod created while the agent is down (restart, upgrade, crash) still runs ``istio-cni``,
which answers ambient pods "try again later" (CNI code 11) until an agent is back and
lets every other pod through (:mod:`cni.plugin`, fallback decision). That is upstream's
safe upgrade (``cni/pkg/cmd/root.go``: the plugin is kept "to stall new ambient-enabled
pods while our replacement spins up"). Only ``ambient_disable_safe_upgrade`` (the node
is being decommissioned, as upstream's ``AMBIENT_DISABLE_SAFE_UPGRADE``) removes it at
stop; ``ambient-agent cni uninstall`` removes it at any time.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

from prometheus_client import Counter, Gauge

from agent.core.lifecycle import AgentContext, Component
from cni import conflist
from cni.install import Installer, NoPrimaryConfig
from cni.install_plugin import BundleError

log = logging.getLogger(__name__)

BURST = 5
REPAIR_INTERVAL = 1.0
WATCH_DEBOUNCE_MS = 50


class CniInstallerComponent(Component):
    """Owns ``installer``'s files while the agent runs."""

    name = "cni-installer"

    def __init__(self, ctx: AgentContext, installer: Installer):
        self.ctx = ctx
        self.installer = installer
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._problem: str | None = "not installed yet"
        self.repairs = 0
        self._recent: list[float] = []
        # istio-cni's names and results (cni/pkg/install/monitoring.go)
        ready = Gauge("istio_cni_install_ready", "Whether the CNI plugin installation is "
                      "ready or not", registry=ctx.registry)
        ready.set_function(lambda: 1.0 if self._problem is None else 0.0)
        self.installs = Counter("istio_cni_installs", "Total number of CNI plugins installed "
                                "by the Istio CNI installer", ["result"], registry=ctx.registry)

    async def start(self) -> None:
        """Creates the CNI dirs and installs. Raises :class:`agent.core.config.ConfigError`
        naming ``cni_conf_dir``/``cni_bin_dir`` when a dir can't be created, and
        ``cni_force_install`` when another istio-cni is there (nothing is changed)."""
        from agent.core.config import ConfigError

        for setting, path in (("cni_conf_dir", self.installer.conf_dir),
                              ("cni_bin_dir", self.installer.bin_dir)):
            try:
                await self.ctx.run_blocking(os.makedirs, path, 0o755, True)
            except OSError as e:
                raise ConfigError(setting, path, f"cannot create it: {e.strerror or e}",
                                  self.ctx.config.origins.get(setting, "")) from None
        if not self.installer.force:
            found = await self.ctx.run_blocking(self.installer.foreign)
            if found:
                raise ConfigError("cni_force_install", False, "; ".join(found) + ": refusing "
                                  "to replace another istio-cni (set cni_force_install=true "
                                  "to replace it, or remove it first)")
        await self._reconcile("start")
        self._task = asyncio.get_running_loop().create_task(self._watch())

    async def stop(self, grace: float) -> None:
        self._stop.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, timeout=grace)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                self._task.cancel()
        if not self.ctx.config.ambient_disable_safe_upgrade:
            log.info("istio-cni stays in %s: pods started while no agent runs are held "
                     "(ambient) or let through (others) by the plugin; `ambient-agent cni "
                     "uninstall` removes it", self.installer.conf_dir)
            return
        for line in await self.ctx.run_blocking(self.installer.uninstall):
            log.info("%s (safe upgrade disabled)", line)

    def ready(self) -> tuple[bool, str]:
        return (self._problem is None), (self._problem or "")

    def debug_state(self) -> Any:
        return {"conf_dir": self.installer.conf_dir, "bin_dir": self.installer.bin_dir,
                "problem": self._problem, "repairs": self.repairs}

    def _make_dirs(self) -> None:
        for path in (self.installer.conf_dir, self.installer.bin_dir):
            os.makedirs(path, mode=0o755, exist_ok=True)

    def _check(self) -> str | None:
        """:meth:`Installer.check`, with an unreadable file reported as the problem."""
        try:
            return self.installer.check()
        except OSError as e:
            return f"cannot check the installation: {e}"

    async def _reconcile(self, why: str) -> None:
        """Check; install if needed. Never raises: a bad file is logged and waited out."""
        problem = await self.ctx.run_blocking(self._check)
        if problem is None:
            self._problem = None
            return
        await self._throttle()
        try:
            path = await self.ctx.run_blocking(self.installer.install)
        except NoPrimaryConfig as e:
            self._problem = str(e)
            log.warning("cannot install istio-cni yet: %s", e)
            return
        except (conflist.ConflistError, BundleError, OSError) as e:
            self._problem = str(e)
            self.installs.labels("CREATE_CNI_CONFIG_FAILURE").inc()
            log.error("cannot install istio-cni: %s", e)
            return
        self.installs.labels("SUCCESS").inc()
        if why != "start":
            self.repairs += 1
            log.info("repaired istio-cni in %s (%s)", path, problem)
        self._problem = await self.ctx.run_blocking(self._check)

    async def _throttle(self) -> None:
        now = time.monotonic()
        self._recent = [t for t in self._recent if now - t < BURST * REPAIR_INTERVAL] + [now]
        if len(self._recent) > BURST:
            log.warning("istio-cni config rewritten %d times in %.0fs: another component keeps "
                        "reverting %s (with Cilium set cni.exclusive=false)", len(self._recent),
                        BURST * REPAIR_INTERVAL, self.installer.conf_dir)
            await asyncio.sleep(REPAIR_INTERVAL)

    async def _watch(self) -> None:
        import watchfiles

        paths = [self.installer.conf_dir, self.installer.bin_dir]
        while not self._stop.is_set():
            try:
                await self.ctx.run_blocking(self._make_dirs)
                # re-check whenever the watch (re)starts: changes while it was down count
                await self._reconcile("watch")
                async for _changes in watchfiles.awatch(
                        *paths, stop_event=self._stop, debounce=WATCH_DEBOUNCE_MS, step=20,
                        recursive=False, rust_timeout=1000, yield_on_timeout=False):
                    await self._reconcile("change")
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - keep watching; the agent must not die
                log.exception("CNI config watch failed; restarting it")
                await asyncio.sleep(REPAIR_INTERVAL)
