"""The directory config source (the embedded default): every ``*.yaml``/``*.yml``/``*.json``
under ``config_dir``, recursively, watched with watchfiles.

Accepted per file: multi-document YAML, JSON, ``kind: List`` documents (what
``kubectl get -o yaml`` writes) and ztunnel's local-config format (``docs/ambient.md``).
Each file is one *origin* in the store: reloading a file replaces exactly the objects it
defined, so edits become upserts and removed documents / deleted files become deletes.

Pod annotations the agent writes (``ambient.istio.io/redirection``, through
:meth:`DirectorySource.patch_pod_annotations`) are an in-memory *overlay*: the file is
the operator's and is never rewritten; the overlay is applied on top of the Pod every
time its file is reloaded, and dropped when the Pod (same name and uid) is gone. It
does not outlive the process: the enrollment's own records restore it after a restart.

A bad object is skipped with a log line naming file, document index, kind and name; the
rest of the file still loads. A file that does not parse as a whole (a YAML/JSON syntax
error, an unreadable file, a local-config document with a bad entry) keeps the objects of
its last good version until it parses again: an editor saving a half-written file must not
withdraw its pods from xDS. That is logged at WARNING (file, line, reason), counted in
``ambient_agent_config_file_errors_total{reason}`` and shown by
``ambient_agent_config_files_stale``.
A file seen for the first time in that state loads what parsed (the documents before a
syntax error). Parsing runs off the event loop; the initial load completes before
:meth:`DirectorySource.start` returns, so the agent is consistent when it reports ready.

A reload parses only the documents that changed: a YAML file is cut into chunks on its
column-0 ``---`` lines (:func:`split_chunks`), and the source keeps, per file, the chunks'
texts with the objects they parsed to; a chunk with the same text reuses them (one pod
changed in a 5,000-pod file parses one chunk). Directive files, a chunk that does not
parse, and a ``kind: List`` (one chunk) are parsed whole (:func:`parse_file`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator

import watchfiles
import yaml
from prometheus_client import CollectorRegistry, Counter, Gauge

from agent.core import yamlsafe
from agent.core.config import ConfigError
from agent.core.config_values import DNS_LABEL, DNS_SUBDOMAIN
from ambient import localconfig
from ambient.store import ObjectStore

log = logging.getLogger(__name__)

SUFFIXES = (".yaml", ".yml", ".json")


class _TagLoader(yamlsafe.BoundedLoader):
    """The agent's bounded safe loader (libyaml's when PyYAML has it; aliases may not
    expand a document past :data:`agent.core.yamlsafe.MAX_ALIAS_NODES` extra nodes),
    plus local tags (``!Exact a``) read as :class:`ambient.localconfig.Tagged`: ztunnel's
    local-config format writes enums with them. ``tags_seen`` counts them so a Kubernetes
    document carrying one is refused. Strict keys: a mapping that gives a key twice
    makes its file not parse (named by line), as kubectl and ztunnel refuse it, instead
    of the later value winning unseen."""

    tags_seen = 0
    strict_keys = True


def _construct_tagged(loader: _TagLoader, suffix: str, node: yaml.Node) -> localconfig.Tagged:
    loader.tags_seen += 1
    value: Any
    if isinstance(node, yaml.ScalarNode):
        kind, value = "scalar", loader.construct_scalar(node)
        plain_empty = value == "" and not node.style  # plain: None (or "" from libyaml)
    elif isinstance(node, yaml.SequenceNode):
        kind, value, plain_empty = "sequence", loader.construct_sequence(node, deep=True), False
    else:
        kind, value, plain_empty = "mapping", loader.construct_mapping(node, deep=True), False
    return localconfig.Tagged(tag=suffix, value=value, node=kind, plain_empty=plain_empty)


_TagLoader.add_multi_constructor("!", _construct_tagged)


Chunks = dict[str, list[Any]]
"""A file's parse cache: the exact text of each of its chunks (see :func:`split_chunks`)
-> the documents that chunk parses to."""


@dataclasses.dataclass
class ParsedFile:
    """One file's content: ``objects`` as ``(object, where)``, ``errors`` as
    ``(where, error)`` for skipped entries, and ``broken``: why the file as a whole did not
    parse (``"malformed YAML at line 3: ..."``), empty when it did. ``broken_kind`` is the
    metric reason: ``syntax``, ``unreadable`` or ``local-config``. ``chunks`` is the
    file's parse cache to pass to the next :func:`parse_file` of it (empty for JSON, or
    when the text was parsed whole); ``chunks_parsed``/``chunks_reused`` count how many
    chunks were parsed and how many came from the cache given."""

    objects: list[tuple[dict, str]]
    errors: list[tuple[str, str]]
    broken: str = ""
    broken_kind: str = ""
    chunks: Chunks = dataclasses.field(default_factory=dict)
    chunks_parsed: int = 0
    chunks_reused: int = 0

    def __iter__(self) -> Iterator[list]:  # ``objects, errors = parse_file(path)``
        return iter((self.objects, self.errors))


class PodNotFound(LookupError):
    """patch_pod_annotations for a pod the source doesn't hold."""


def wanted(path: str) -> bool:
    name = os.path.basename(path)
    return name.endswith(SUFFIXES) and not name.startswith(".")


# A document-start marker: ``---`` at column 0 followed by a space, a tab or the line's end
# (what PyYAML's and libyaml's scanners take as one; kubectl splits multi-document files
# on the same lines).
_DOC_START = re.compile(r"^---(?=[ \t\r\n]|$)", re.MULTILINE)
# Texts parsed whole: a directive (``%YAML``, ``%TAG``) belongs to the document after it.
_DIRECTIVE = re.compile("^%", re.MULTILINE)

def split_chunks(text: str) -> list[str] | None:
    """``text`` cut before every column-0 ``---`` marker line (the first chunk is what
    precedes the first marker, possibly empty), or None when the text must be parsed
    whole (a ``%`` directive line, a byte-order mark past the start). ``"".join(chunks) == text``.

    A ``---`` at column 0 is a document marker wherever it appears in YAML (it ends a
    block scalar, whose content must be indented; inside a quoted scalar or a flow
    collection it is a syntax error), so every chunk holds whole documents."""
    if _DIRECTIVE.search(text) or "\ufeff" in text[1:]:
        return None
    starts = [m.start() for m in _DOC_START.finditer(text)]
    if not starts or starts[0] != 0:
        starts.insert(0, 0)
    starts.append(len(text))
    return [text[a:b] for a, b in zip(starts, starts[1:])]


class _Refused(Exception):
    """A chunk that did not parse cleanly: the caller parses the file whole instead."""


def _parse_run(chunks: list[str]) -> list[list[Any]]:
    """The documents of consecutive ``chunks``, parsed with one loader (the bounded one,
    so the alias and size limits hold per document), as one list per chunk. A chunk
    that starts with ``---`` holds exactly one document (YAML allows an implicit,
    marker-less document only first in a stream); only a file's first chunk may lack
    the marker, and it holds one document or none (comments only). Raises
    :class:`_Refused` on any syntax error, bound, stray tag, or a document count that
    does not fit that shape."""
    marked = sum(1 for chunk in chunks if chunk.startswith("---"))
    docs: list[Any] = []
    try:
        loader = _TagLoader("".join(chunks))
    except yaml.YAMLError as e:
        raise _Refused() from e
    try:
        while loader.check_data():
            loader.tags_seen = 0
            doc = loader.get_data()
            if loader.tags_seen and not localconfig.is_local_config(doc):
                raise _Refused()
            docs.append(doc)
    except yaml.YAMLError as e:
        raise _Refused() from e
    finally:
        loader.dispose()
    lead = len(docs) - marked  # documents in an unmarked first chunk: 0 or 1
    if lead not in (0, 1) or (lead and chunks[0].startswith("---")):
        raise _Refused()
    out: list[list[Any]] = []
    i = 0
    for chunk in chunks:
        take = 1 if chunk.startswith("---") else lead
        out.append(docs[i:i + take])
        i += take
    return out


@dataclasses.dataclass
class _ChunkStats:
    parsed: int = 0  # chunks parsed in this call
    reused: int = 0  # chunks whose documents came from the cache


def _chunked_docs(text: str, cache: Chunks | None, fresh: Chunks,
                  stats: _ChunkStats) -> list[Any] | None:
    """All documents of ``text``, reusing ``cache`` for chunks whose text it holds and
    filling ``fresh`` with every chunk of ``text`` (so chunks gone from the file drop out
    of the cache). None when the text must be parsed whole (not splittable, or a chunk
    did not parse cleanly)."""
    chunks = split_chunks(text)
    if chunks is None:
        return None
    cache = cache or {}
    docs: list[Any] = []
    run: list[str] = []  # consecutive chunks not in the cache, parsed with one loader

    def flush() -> None:
        for chunk, got in zip(run, _parse_run(run)):
            fresh[chunk] = got
            docs.extend(got)
        stats.parsed += len(run)
        run.clear()

    try:
        for chunk in chunks:
            got = cache.get(chunk)
            if got is None:
                run.append(chunk)
                continue
            if run:
                flush()
            fresh[chunk] = got
            docs.extend(got)
            stats.reused += 1
        if run:
            flush()
    except _Refused:
        return None
    return docs


def _docs(path: str, text: str, cache: Chunks | None = None,
          fresh: Chunks | None = None, stats: _ChunkStats | None = None
          ) -> tuple[list[Any], str]:
    """All documents of a file, and the syntax error (with line) that stopped parsing, if any.

    With ``fresh`` (a dict to fill), YAML is parsed chunk by chunk (:func:`_chunked_docs`):
    only chunks not in ``cache`` are parsed. A text that cannot be split, or any chunk
    that does not parse cleanly, is parsed whole as without a cache, so an error names
    the line in the file and the documents before it are the ones loaded; ``fresh`` is
    then left empty."""
    if path.endswith(".json"):
        try:
            return [json.loads(text)], ""
        except json.JSONDecodeError as e:
            return [], f"malformed JSON at line {e.lineno}: {e.msg}"
    if fresh is not None:
        got = _chunked_docs(text, cache, fresh, stats or _ChunkStats())
        if got is not None:
            return got, ""
        fresh.clear()
    docs: list[Any] = []
    try:
        loader = _TagLoader(text)
    except yaml.YAMLError as e:
        return docs, f"malformed YAML: {e}"
    try:
        while loader.check_data():
            loader.tags_seen = 0
            doc = loader.get_data()
            if loader.tags_seen and not localconfig.is_local_config(doc):
                return docs, (f"document #{len(docs)}: a YAML tag such as '!Exact' is "
                              f"allowed only in ztunnel's local-config format")
            docs.append(doc)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        why = yamlsafe.short_text(str(getattr(e, "problem", None) or e), 300)
        return docs, f"malformed YAML{where}: {why}"
    finally:
        loader.dispose()
    return docs, ""


def _label(obj: Any) -> str:
    if not isinstance(obj, dict):
        return type(obj).__name__
    raw = obj.get("metadata")
    meta: dict = raw if isinstance(raw, dict) else {}
    name = _shown(meta.get("name", "?"))
    ns = _shown(meta.get("namespace"))
    # a malformed object (``namespace: 5``, a list) is labelled here and rejected by the store
    return f"{_shown(obj.get('kind', '?'))} {f'{ns}/' if ns else ''}{name}"


def _shown(value: Any) -> str:
    """A name for a log line: a printable string cut short, anything else (a string with a
    control byte such as ESC or a newline included) as a bounded repr."""
    if isinstance(value, str) and value.isprintable():
        return yamlsafe.short_text(value, 253)
    return "" if value is None else yamlsafe.short_repr(value, 80)


def parse_file(path: str, cache: Chunks | None = None) -> ParsedFile:
    """Read one file into a :class:`ParsedFile`.

    ``where`` is ``<path>#<document index>[.items[i]]`` with the kind and name when known.
    ``cache`` is the ``chunks`` of the previous :class:`ParsedFile` of this file: a YAML
    file is split into chunks on its column-0 ``---`` lines (:func:`split_chunks`) and
    only chunks whose exact text the cache lacks are parsed, so one pod changed in a
    5,000-document file parses one chunk; the documents of the others are the cache's
    objects themselves (nothing downstream mutates parsed objects). A ``kind: List``
    document is one chunk and is parsed whole. Blocking (reads the file): call it off
    the event loop. The cache is only read: the new one is in the result.
    """
    try:
        size = os.stat(path).st_size
        if size > yamlsafe.MAX_BYTES:
            return ParsedFile([], [], f"too large: {size} bytes, more than the "
                              f"{yamlsafe.MAX_BYTES} a config file may have", "unreadable")
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        return ParsedFile([], [], f"cannot read: {e}", "unreadable")
    fresh: Chunks = {}
    stats = _ChunkStats()
    docs, error = _docs(path, text, cache, fresh, stats)
    out = ParsedFile([], [], error, "syntax" if error else "", fresh, stats.parsed,
                     stats.reused)
    objects, errors = out.objects, out.errors
    for i, doc in enumerate(docs):
        where = f"{path}#{i}"
        if doc is None:
            continue
        if localconfig.is_local_config(doc):
            bad = 0
            for obj, label, err in localconfig.to_objects(doc):
                if obj is None:
                    errors.append((f"{where} {label}", err))
                    bad += 1
                else:
                    objects.append((obj, f"{where} {label}"))
            if bad and not out.broken:
                out.broken = (f"local-config document #{i} rejected whole: {bad} bad "
                              f"entr{'y' if bad == 1 else 'ies'} (named above)")
                out.broken_kind = "local-config"
        elif isinstance(doc, dict) and doc.get("kind") == "List":
            items = doc.get("items")
            if not isinstance(items, list):
                errors.append((where, f"kind List: field 'items' must be a list, got "
                                      f"{yamlsafe.short_repr(items)}"))
                continue
            for j, item in enumerate(items):
                _add_checked(objects, errors, item, f"{where}.items[{j}] {_label(item)}")
        else:
            _add_checked(objects, errors, doc, f"{where} {_label(doc)}")
    return out


_DNS_1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
# kind -> (pattern, longest, rule): what the API server's validation requires of the
# name (apimachinery ValidatePodName, ValidateNamespaceName, ValidateServiceName)
_NAME_RULES = {
    "Pod": (DNS_SUBDOMAIN, 253, "DNS-1123 subdomain: lowercase letters, digits, '-' and "
                                 "'.', at most 253 characters"),
    "Namespace": (DNS_LABEL, 63, "DNS-1123 label: lowercase letters, digits and '-', at "
                                  "most 63 characters"),
    "Service": (_DNS_1035, 63, "DNS-1035 label: lowercase letters, digits and '-', "
                               "starting with a letter, at most 63 characters"),
}


# apimachinery's IsQualifiedName (label keys) and IsValidLabelValue
_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_LABEL_KEY_RULE = ("a qualified name: an optional DNS-1123 subdomain prefix and '/', then at "
                   "most 63 of [A-Za-z0-9._-], beginning and ending alphanumeric")
_LABEL_VALUE_RULE = ("empty or at most 63 of [A-Za-z0-9._-], beginning and ending "
                     "alphanumeric")


def _label_key_ok(key: str) -> bool:
    prefix, slash, name = key.rpartition("/")
    if slash and (not prefix or len(prefix) > 253 or not DNS_SUBDOMAIN.fullmatch(prefix)):
        return False
    return 0 < len(name) <= 63 and bool(_LABEL_NAME.fullmatch(name))


def _labels_problem(value: Any, path: str) -> str:
    """Why a label map would be refused (apimachinery ValidateLabels), "" if it would not;
    a map that is not of strings is the store's to name."""
    if not isinstance(value, dict):
        return ""
    for key, val in value.items():
        if not isinstance(key, str) or not isinstance(val, str):
            continue
        if not _label_key_ok(key):
            return f"field '{path}' key {_shown_repr(key)} is not valid ({_LABEL_KEY_RULE})"
        if val and (len(val) > 63 or not _LABEL_NAME.fullmatch(val)):
            return (f"field '{path}.{_shown(key)}' value {_shown_repr(val)} is not valid "
                    f"({_LABEL_VALUE_RULE})")
    return ""


def _shown_repr(value: Any) -> str:
    return yamlsafe.short_repr(value, 80)


def name_problem(obj: Any) -> str:
    """Why a hand-written object would be refused by a Kubernetes API server ("" if it
    would not): ``metadata.name`` (a Namespace's a DNS-1123 label, a Service's a DNS-1035
    label, any other kind's a DNS-1123 subdomain), any object's
    ``metadata.namespace`` (a DNS-1123 label) and ``metadata.labels`` (qualified-name keys,
    values of at most 63 of [A-Za-z0-9._-] beginning and ending alphanumeric), a Pod's
    ``spec.serviceAccountName`` (a DNS-1123 subdomain, ValidateServiceAccountName) and a
    WorkloadEntry's ``spec.labels`` (Istio validates them as labels). Other shapes are the
    store's to check. Values are named as bounded reprs (control bytes escaped)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("metadata"), dict):
        return ""
    meta = obj["metadata"]
    kind = obj.get("kind")
    # every other kind an API server stores is named by a DNS-1123 subdomain (generic
    # object-meta validation, custom resources included)
    rule = _NAME_RULES.get(kind, _NAME_RULES["Pod"]) if isinstance(kind, str) else None
    name = meta.get("name")
    if rule is not None and isinstance(name, str) and name:
        pattern, longest, text = rule
        if len(name) > longest or not pattern.fullmatch(name):
            return (f"field 'metadata.name' {_shown_repr(name)} is not a valid "
                    f"{_shown(kind)} name ({text})")
    ns = meta.get("namespace")
    if isinstance(ns, str) and ns and (len(ns) > 63 or not DNS_LABEL.fullmatch(ns)):
        return (f"field 'metadata.namespace' {_shown_repr(ns)} is not a valid namespace name "
                f"({_NAME_RULES['Namespace'][2]})")
    problem = _labels_problem(meta.get("labels"), "metadata.labels")
    spec = obj.get("spec")
    if not problem and kind == "WorkloadEntry" and isinstance(spec, dict):
        problem = _labels_problem(spec.get("labels"), "spec.labels")
    if not problem and kind == "Pod" and isinstance(spec, dict):
        sa = spec.get("serviceAccountName")
        if isinstance(sa, str) and sa and (len(sa) > 253 or not DNS_SUBDOMAIN.fullmatch(sa)):
            problem = (f"field 'spec.serviceAccountName' {_shown_repr(sa)} is not a valid "
                       f"ServiceAccount name ({_NAME_RULES['Pod'][2]})")
    return problem


def _add_checked(objects: list, errors: list, obj: Any, where: str) -> None:
    problem = name_problem(obj)
    if problem:
        errors.append((where, problem))
    else:
        objects.append((obj, where))


def _with_annotations(obj: dict, changes: dict[str, str | None]) -> dict:
    """A copy of ``obj`` (shallow, new ``metadata`` and ``annotations``) with ``changes``
    applied: a value sets the annotation, None removes it."""
    meta = dict(obj.get("metadata") or {})
    merged = dict(meta.get("annotations") or {})
    for key, value in changes.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = value
    if merged or "annotations" in meta:
        meta["annotations"] = merged
    out = dict(obj)
    out["metadata"] = meta
    return out


def scan(directory: str) -> list[str]:
    """Every wanted file under ``directory``, sorted (so load order is reproducible)."""
    out: list[str] = []
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
                 run_blocking: Callable[..., Awaitable[Any]], debounce_ms: int = 50,
                 registry: CollectorRegistry | None = None):
        self.store = store
        self.directory = os.path.abspath(directory)
        self.run_blocking = run_blocking
        self.debounce_ms = debounce_ms
        self.loaded = False
        self.files: set[str] = set()
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._good: set[str] = set()  # files whose objects in the store are a whole parse
        self._stale: set[str] = set()  # files held at their last good version
        self._chunks: dict[str, Chunks] = {}  # path -> its parse cache (parse_file)
        self.chunks_parsed = 0  # YAML chunks parsed, over all reloads
        self.chunks_reused = 0  # YAML chunks whose objects came from the cache
        registry = registry if registry is not None else CollectorRegistry()
        self._file_errors = Counter(
            "ambient_agent_config_file_errors", "config files that did not parse as a whole, by "
            "reason (syntax, unreadable, local-config)", ["reason"], registry=registry)
        self._stale_gauge = Gauge(
            "ambient_agent_config_files_stale", "config files whose objects are kept from their "
            "last good version because the current content does not parse",
            registry=registry)
        # (namespace, name) -> (uid, {annotation: value or None = removed})
        self._overlay: dict[tuple[str, str], tuple[str, dict[str, str | None]]] = {}
        # the directory was removed while running (warned once; objects kept)
        self.directory_missing = False

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
        """Re-read one file (or drop its objects if it is gone) as one store transaction.

        A file that does not parse as a whole keeps its last good objects (module
        docstring)."""
        if os.path.isfile(path):
            try:
                parsed = await self.run_blocking(parse_file, path, self._chunks.get(path))
            except Exception as e:  # an unexpected parser failure must not stop the
                # source; the file's previous objects stay until it parses again
                parsed = ParsedFile([], [], f"cannot parse: {e!r}", "syntax")
            self.files.add(path)
            if parsed.chunks or not parsed.broken:
                self._chunks[path] = parsed.chunks
            self.chunks_parsed += parsed.chunks_parsed
            self.chunks_reused += parsed.chunks_reused
        else:
            parsed = ParsedFile([], [])
            self.files.discard(path)
            self._chunks.pop(path, None)
        # there, but not a regular file (a symlink to a device or FIFO): never read
        refused = not os.path.isfile(path) and os.path.lexists(path)
        if refused:
            log.warning("config file %s refused: not a regular file (%s); its objects, if "
                        "any, are dropped", path, _file_kind(path))
        objects, errors = parsed.objects, parsed.errors
        for where, error in errors:
            self.store.reject("invalid", where, error)
        if parsed.broken:
            self._file_errors.labels(parsed.broken_kind).inc()
            if path in self._good:
                self._stale.add(path)
                self._stale_gauge.set(len(self._stale))
                log.warning("config file %s: %s; keeping its %d objects from the last good "
                            "version until it parses again", path, parsed.broken,
                            self.store.objects_of_origin(path))
                return
            log.warning("config file %s: %s; no earlier good version, loading the %d "
                        "objects that parsed", path, parsed.broken, len(objects))
        elif path in self.files:
            self._good.add(path)
        else:
            self._good.discard(path)
        if path in self._stale:
            log.info("config file %s parses again", path)
            self._stale.discard(path)
            self._stale_gauge.set(len(self._stale))
        if self._overlay:
            objects = [(self._overlaid(obj), where) for obj, where in objects]
        held_before = self.store.objects_of_origin(path)
        self.store.replace_origin(path, objects)
        if self._overlay:
            self._drop_stale_overlay()
        if self._task is not None:  # after the initial load: say what the file holds now
            held = self.store.objects_of_origin(path)
            skipped = len(objects) - held + len(errors)
            if path not in self.files and not refused:
                # what went with it, not what it holds now (always 0)
                log.info("config file %s removed: its %d objects deleted", path, held_before)
                return
            log.info("config file %s %s: %d objects%s", path,
                     "reloaded" if path in self.files else "refused", held,
                     f", {skipped} skipped (reasons logged above)" if skipped else "")

    # --- annotations written by the agent (overlay) ---

    async def patch_pod_annotations(self, namespace: str, name: str,
                                    annotations: dict[str, str | None]) -> dict:
        """Set (value) or remove (None) annotations on the stored Pod ``namespace/name``
        as an overlay (the file is not rewritten; a reload of the file keeps the
        overlay). Returns the updated Pod (a new dict; the store holds it). Raises
        :class:`PodNotFound` when no file defines that Pod."""
        current = self.store.get("Pod", namespace, name)
        if current is None:
            raise PodNotFound(f"pod {namespace}/{name} not found in the config source")
        uid = str((current.get("metadata") or {}).get("uid") or "")
        key = (namespace, name)
        held = self._overlay.get(key)
        changes = dict(held[1]) if held is not None and held[0] == uid else {}
        changes.update({str(k): (None if v is None else str(v)) for k, v in annotations.items()})
        self._overlay[key] = (uid, changes)
        pod = _with_annotations(current, changes)
        # the owning file keeps owning the object, so a reload of that file replaces it
        origin = self.store.origin_of(("Pod", namespace, name)) or "patch"
        self.store.apply([(pod, f"annotation overlay on pod {namespace}/{name}")],
                         origin=origin)
        return pod

    def overlay(self) -> dict[str, dict[str, str | None]]:
        """``{"namespace/name": {annotation: value or None}}`` (for /debug and tests)."""
        return {f"{ns}/{name}": dict(ch) for (ns, name), (_uid, ch) in self._overlay.items()}

    def _overlaid(self, obj: Any) -> Any:
        """``obj`` with its overlay applied, when it is a Pod with one (same uid)."""
        if not isinstance(obj, dict) or obj.get("kind") != "Pod":
            return obj
        meta = obj.get("metadata")
        if not isinstance(meta, dict) or not isinstance(meta.get("name"), str):
            return obj
        namespace = meta.get("namespace") or "default"
        held = self._overlay.get((namespace, meta["name"])) if isinstance(namespace, str) else None
        if held is None or held[0] != str(meta.get("uid") or ""):
            return obj
        if meta.get("annotations") is not None and not isinstance(meta["annotations"], dict):
            return obj  # malformed: the store rejects it with its own message
        return _with_annotations(obj, held[1])

    def _drop_stale_overlay(self) -> None:
        """Forget overlays of Pods that are gone or are now another pod (new uid)."""
        for key, (uid, _changes) in list(self._overlay.items()):
            pod = self.store.get("Pod", *key)
            if pod is None or str((pod.get("metadata") or {}).get("uid") or "") != uid:
                del self._overlay[key]

    async def _watch(self) -> None:
        """Follow the directory; when the watch ends (the directory itself was removed,
        whose inotify watch then never fires again) or fails (inotify limits...), wait for
        the directory to be there (it is not re-created: a removed config dir is the
        operator's doing, and an empty one would look like "no objects"), reconcile, and
        watch again. While it is gone the store keeps the objects last read from it."""
        while not self._stop.is_set():
            try:
                await self._follow()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("watching %s failed; retrying", self.directory)
            if self._stop.is_set():
                return
            if not await self._wait_for_directory():
                return
            await self._rescan()

    async def _wait_for_directory(self) -> bool:
        """Poll (1 s) until :attr:`directory` is a directory again; False on stop."""
        while not os.path.isdir(self.directory):
            try:
                await asyncio.wait_for(self._stop.wait(), 1.0)
                return False
            except asyncio.TimeoutError:
                pass
        if self.directory_missing:
            self.directory_missing = False
            log.info("config directory %s is back; reading it again", self.directory)
        return not self._stop.is_set()

    def _directory_gone(self) -> bool:
        """Whether the directory is gone; the first time, one WARN."""
        if os.path.isdir(self.directory):
            return False
        if not self.directory_missing:
            self.directory_missing = True
            log.warning("config directory %s was removed (or is no longer a directory); "
                        "keeping the %d objects last read from it until it is back (it is "
                        "not re-created)", self.directory, len(self.store))
        return True

    async def _follow(self) -> None:
        """Apply file events until the stop event or the removal of the directory. The
        deletions a directory removal reports are not applied (its files' objects stay)."""
        async for changes in watchfiles.awatch(self.directory, recursive=True,
                                               debounce=self.debounce_ms, step=20,
                                               stop_event=self._stop):
            if self._directory_gone():
                return
            for path in sorted({p for _, p in changes}):
                if not os.path.lexists(path) and self._directory_gone():
                    return
                if wanted(path) or path in self.files:
                    await self.reload(path)
                elif os.path.isdir(path) or path == self.directory:
                    await self._rescan()
            if self._directory_gone():
                return

    async def _rescan(self) -> None:
        """A directory appeared or vanished: reconcile every known and present file."""
        present = set(await self.run_blocking(scan, self.directory))
        for path in sorted(present | self.files):
            if path not in present or path not in self.files:
                await self.reload(path)


def _file_kind(path: str) -> str:
    """What ``path`` is when it is not a regular file, in words (for a log line)."""
    import stat

    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "a symlink loop"
        if e.errno == errno.ENOENT:
            return "a dangling symlink"
        return f"a symlink that cannot be followed: {e.strerror}"
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"
