"""The directory config source (the embedded default): every ``*.yaml``/``*.yml``/``*.json``
under ``config_dir``, recursively, watched with watchfiles.

Accepted per file: multi-document YAML, JSON, ``kind: List`` documents (what
``kubectl get -o yaml`` writes) and ztunnel's local-config format (spec ambient-wds.md §6).
Each file is one *origin* in the store: reloading a file replaces exactly the objects it
defined, so edits become upserts and removed documents / deleted files become deletes.

A bad object is skipped with a log line naming file, document index, kind and name; the
rest of the file still loads. A YAML syntax error keeps the documents before it. Parsing
runs off the event loop; the initial load completes before :meth:`DirectorySource.start`
returns, so the agent is consistent when it reports ready.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
from pathlib import Path
from typing import Any, Awaitable, Callable

import watchfiles
import yaml

from agent.config import ConfigError
from ambient import localconfig
from ambient.store import ObjectStore

log = logging.getLogger("ambient.source.files")

SUFFIXES = (".yaml", ".yml", ".json")
Parsed = tuple[list[tuple[dict, str]], list[tuple[str, str]]]  # (objects, [(where, error)])


def wanted(path: str) -> bool:
    name = os.path.basename(path)
    return name.endswith(SUFFIXES) and not name.startswith(".")


def _docs(path: str, text: str) -> tuple[list[Any], str]:
    """All documents of a file, and the syntax error (with line) that stopped parsing, if any."""
    if path.endswith(".json"):
        try:
            return [json.loads(text)], ""
        except json.JSONDecodeError as e:
            return [], f"malformed JSON at line {e.lineno}: {e.msg}"
    docs: list[Any] = []
    try:
        for doc in yaml.safe_load_all(text):
            docs.append(doc)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        return docs, f"malformed YAML{where}: {getattr(e, 'problem', None) or e}"
    return docs, ""


def _label(obj: Any) -> str:
    if not isinstance(obj, dict):
        return type(obj).__name__
    meta = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
    name = meta.get("name", "?")
    ns = meta.get("namespace")
    # str(): a malformed object (``namespace: 5``) is labelled here and rejected by the store
    return f"{obj.get('kind', '?')} {f'{ns}/' if ns else ''}{name}"


def parse_file(path: str) -> Parsed:
    """Read one file into ``(object, where)`` pairs plus ``(where, error)`` rejections.

    ``where`` is ``<path>#<document index>[.items[i]]`` with the kind and name when known.
    Blocking (reads the file): call it off the event loop.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        return [], [(path, f"cannot read: {e}")]
    docs, error = _docs(path, text)
    objects: list[tuple[dict, str]] = []
    errors: list[tuple[str, str]] = []
    if error:
        errors.append((f"{path}#{len(docs)}", error))
    for i, doc in enumerate(docs):
        where = f"{path}#{i}"
        if doc is None:
            continue
        if localconfig.is_local_config(doc):
            for obj, label, err in localconfig.to_objects(doc):
                if obj is None:
                    errors.append((f"{where} {label}", err))
                else:
                    objects.append((obj, f"{where} {label}"))
        elif isinstance(doc, dict) and doc.get("kind") == "List":
            items = doc.get("items")
            if not isinstance(items, list):
                errors.append((where, f"kind List: field 'items' must be a list, got {items!r}"))
                continue
            objects.extend((item, f"{where}.items[{j}] {_label(item)}")
                           for j, item in enumerate(items))
        else:
            objects.append((doc, f"{where} {_label(doc)}"))
    return objects, errors


def scan(directory: str) -> list[str]:
    """Every wanted file under ``directory``, sorted (so load order is reproducible)."""
    out = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        out.extend(os.path.join(root, f) for f in sorted(files) if wanted(f))
    return out


class DirectorySource:
    """Fills an :class:`ObjectStore` from a directory and keeps it in sync.

    ``run_blocking`` is ``AgentContext.run_blocking`` (file I/O and YAML parsing off the
    loop). ``debounce`` (milliseconds) groups bursts of file events, as editors write
    files in several steps.
    """

    def __init__(self, store: ObjectStore, directory: str,
                 run_blocking: Callable[..., Awaitable[Any]], debounce_ms: int = 50):
        self.store = store
        self.directory = os.path.abspath(directory)
        self.run_blocking = run_blocking
        self.debounce_ms = debounce_ms
        self.loaded = False
        self.files: set[str] = set()
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.reloads = 0

    async def start(self) -> None:
        """Create the directory if missing (0750) and start watching it. Raises
        :class:`ConfigError` naming ``config_dir`` when it can't be created (e.g. a file
        sits at the path)."""
        try:
            os.makedirs(self.directory, mode=0o750, exist_ok=True)
        except OSError as e:
            reason = ("exists and is not a directory" if e.errno == errno.EEXIST
                      else e.strerror or str(e))
            raise ConfigError("config_dir", self.directory, reason) from None
        self._stop.clear()
        # Watch first, then scan: a file written in between is seen by one or the other
        # (a reload of an unchanged file produces no store events).
        self._task = asyncio.create_task(self._watch(), name="ambient-files-watch")
        for _ in range(3):  # let the task set up its inotify watch (first await in awatch)
            await asyncio.sleep(0)
        paths = await self.run_blocking(scan, self.directory)
        for path in paths:
            await self.reload(path)
        self.loaded = True
        log.info("loaded %d objects from %d files under %s", len(self.store), len(paths),
                 self.directory)

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None

    async def reload(self, path: str) -> None:
        """Re-read one file (or drop its objects if it is gone) as one store transaction."""
        if os.path.isfile(path):
            try:
                objects, errors = await self.run_blocking(parse_file, path)
            except Exception as e:  # an unexpected parser failure must not stop the
                # source; the file's previous objects stay until it parses again
                self.store.reject("invalid", path, f"cannot parse: {e!r}")
                return
            self.files.add(path)
        else:
            objects, errors = [], []
            self.files.discard(path)
        for where, error in errors:
            self.store.reject("invalid", where, error)
        self.store.replace_origin(path, objects)
        self.reloads += 1
        if self._task is not None:  # after the initial load: say what the file holds now
            held = self.store.objects_of_origin(path)
            skipped = len(objects) - held + len(errors)
            log.info("config file %s %s: %d objects%s", path,
                     "reloaded" if path in self.files else "removed", held,
                     f", {skipped} skipped (reasons logged above)" if skipped else "")

    async def _watch(self) -> None:
        """Follow the directory; when the watch ends (the directory itself was removed,
        whose inotify watch then never fires again) or fails (inotify limits...), recreate
        the directory as :meth:`start` does, reconcile, and watch again."""
        while not self._stop.is_set():
            try:
                await self._follow()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("watching %s failed; retrying", self.directory)
            if self._stop.is_set():
                return
            await asyncio.sleep(1.0)
            try:
                os.makedirs(self.directory, mode=0o750, exist_ok=True)
            except OSError as e:  # e.g. a file now sits at the path: retry later
                log.warning("cannot create %s: %s", self.directory, e)
                continue
            await self._rescan()

    async def _follow(self) -> None:
        """Apply file events until the stop event or the removal of the directory."""
        async for changes in watchfiles.awatch(self.directory, recursive=True,
                                               debounce=self.debounce_ms, step=20,
                                               stop_event=self._stop):
            for path in sorted({p for _, p in changes}):
                if wanted(path) or path in self.files:
                    await self.reload(path)
                elif os.path.isdir(path) or path == self.directory:
                    await self._rescan()
            if not os.path.isdir(self.directory):
                log.warning("config directory %s was removed; its objects are dropped "
                            "until it is back", self.directory)
                return

    async def _rescan(self) -> None:
        """A directory appeared or vanished: reconcile every known and present file."""
        present = set(await self.run_blocking(scan, self.directory))
        for path in sorted(present | self.files):
            if path not in present or path not in self.files:
                await self.reload(path)
