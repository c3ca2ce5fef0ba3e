"""What the demo is made of: its pods, the rows of its table, its error, its constants.

:func:`resolve_runtime` turns ``--runtime`` into what runs the pods.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import sys
import time
import uuid
from pathlib import Path
from typing import TextIO

EXAMPLES_DIR = Path(__file__).resolve().parent.parent.parent / "examples" / "cluster"
RUNTIMES = ("auto", "podman", "netns")
DEMO_LABEL = "io.ambient.demo.workdir"  # on every demo container: its workdir
POD_COMMAND = ("/bin/busybox", "sleep", "infinity")
CNI_PLUGIN_DIRS = ["/usr/lib/cni", "/opt/cni/bin"]
APP_PORT = 8080
LOOPBACK_CONF = {"cniVersion": "1.0.0", "name": "cni-loopback", "type": "loopback"}


@dataclasses.dataclass
class DemoPod:
    """One demo pod: its name, namespace, service account, whether it should be ambient,
    and any labels its Pod object carries besides ``app: <name>``."""

    name: str
    namespace: str
    service_account: str
    ambient: bool
    uid: str = dataclasses.field(default_factory=lambda: str(uuid.uuid4()))
    netns_path: str = ""  # the pod's network namespace (a bind mount under /run/netns)
    ip: str = ""
    container_id: str = dataclasses.field(default_factory=lambda: secrets.token_hex(16))
    labels: dict[str, str] = dataclasses.field(default_factory=dict)  # besides app: <name>


@dataclasses.dataclass
class Check:
    """One row of the result table."""

    subject: str
    what: str
    ok: bool
    detail: str


@dataclasses.dataclass
class ZtunnelWorkload:
    """A workload as a real ztunnel holds it (from its ``/config_dump``)."""

    name: str
    service_account: str
    protocol: str  # "HBONE" or "TCP" (ztunnel's names)


class DemoError(RuntimeError):
    """A step of the demo could not be done; the message says which and why."""


class DemoInterrupted(DemoError):
    """Ctrl-C (or SIGTERM) during the bring-up: the steps stop, the teardown runs."""


class Progress:
    """Prints a step, then its duration when it ends; steps over a second show a ticker.

    ``stop``: when set (the demo's Ctrl-C), the next step raises
    :class:`DemoInterrupted` instead of starting, so a bring-up stops at the end of the
    step it is in (a step's own threads are not cut off halfway: the teardown then finds
    what it made)."""

    def __init__(self, stream: TextIO = sys.stdout) -> None:
        self.stream = stream
        self.stop: asyncio.Event | None = None
        self._open: str | None = None  # the title of a step line not ended yet

    def interrupt(self) -> None:
        """End the step line now (its result follows on a line of its own), so another
        writer's line (the agent's log) starts at the beginning of a line."""
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = ""  # still in the step, its line broken

    def log_filter(self) -> logging.Filter:
        """A filter for log handlers writing to the same terminal: each record first ends
        an open step line (:meth:`interrupt`); no record is dropped."""
        progress = self

        class _Break(logging.Filter):
            def filter(self, record: logging.LogRecord) -> bool:
                progress.interrupt()
                return True
        return _Break()

    def check_stop(self, before: str) -> None:
        if self.stop is not None and self.stop.is_set():
            raise DemoInterrupted(f"interrupted before {before}")

    @contextlib.asynccontextmanager
    async def step(self, title: str):
        self.check_stop(title)
        t0 = time.monotonic()
        self.stream.write(f"  • {title} ...")
        self.stream.flush()
        self._open = title

        async def ticker():
            while True:
                await asyncio.sleep(1.0)
                if self._open == title:  # the line is still ours
                    self.stream.write(".")
                    self.stream.flush()

        def end(result: str) -> None:
            broken = self._open != title  # something else wrote a line meanwhile
            self._open = None
            self.stream.write((f"  • {title}: {result}" if broken else f" {result}") + "\n")
            self.stream.flush()

        tick = asyncio.create_task(ticker())
        try:
            yield
        except BaseException:
            end("failed")
            raise
        finally:
            tick.cancel()
        end(f"done ({time.monotonic() - t0:.1f}s)")


def resolve_runtime(choice: str) -> str:
    """``auto`` → ``podman`` when podman and runc are installed, else ``netns``; other
    values pass through. Raises DemoError for an unknown value or missing podman."""
    from agent.demo import podman as podman_mod

    if choice not in RUNTIMES:
        raise DemoError(f"--runtime must be one of {', '.join(RUNTIMES)}, got {choice!r}")
    if choice == "auto":
        return "podman" if podman_mod.available() else "netns"
    if choice == "podman" and not podman_mod.available():
        raise DemoError("--runtime podman: podman and runc must be installed "
                        "(apt-get install podman runc)")
    return choice
