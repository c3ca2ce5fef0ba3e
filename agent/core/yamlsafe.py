"""The one YAML loader for everything the agent reads: PyYAML's safe loader (libyaml's when
PyYAML was built with it) with bounded alias expansion and bounded input size, and a
bounded ``repr`` for putting a parsed value into a log line or an error.

Why: YAML aliases let a few hundred bytes stand for a structure of millions of nodes (the
"billion laughs" document: nine aliases of nine aliases of ...). PyYAML's composer keeps an
alias as a second reference to the anchored node, so parsing stays small, but everything
that walks the value afterwards (equality, ``repr`` in an error message, JSON, the index)
pays for the expanded size: a 400-byte document in a pod's ``metadata.labels`` once got the
agent killed for memory, and at one level less it logged a single 34 MB line. Go's
``gopkg.in/yaml`` (what Kubernetes parses with) refuses such documents ("document contains
excessive aliasing"); so does this loader, by counting the nodes each document expands to
before anything is constructed from it.

- :class:`BoundedLoader`: the safe loader; each document's node graph is measured
  (:func:`expanded_nodes`, shared nodes counted once per reference, memoized so the walk is
  linear in the distinct nodes) and refused with :class:`AliasBombError` when aliases add
  more than :data:`MAX_ALIAS_NODES` nodes to it, or when an alias refers to a node that
  contains it (a recursive document). Files without a ``*`` cannot hold an alias and are
  not walked.
- :func:`load`: parse text (at most :data:`MAX_BYTES` bytes) with it.
- :func:`short_repr`: ``repr`` bounded in depth, items and characters, computed without
  building the full string, for log lines and error messages.
"""

from __future__ import annotations

import reprlib
from typing import Any, Iterator

import yaml

MAX_ALIAS_NODES = 100_000  # nodes aliases may add to one document beyond its own
MAX_BYTES = 64 * 1024 * 1024  # one YAML text (a 5,000-pod file is about 5 MB)
MAX_LOGGED = 200  # characters of a value in a log line or an error message

_BASE: type = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class AliasBombError(yaml.MarkedYAMLError):
    """A document whose aliases expand past :data:`MAX_ALIAS_NODES` extra nodes, or that
    refers to itself. ``problem`` says which; ``problem_mark`` is the document's start."""


class TooLargeError(yaml.YAMLError):
    """A YAML text longer than :data:`MAX_BYTES`; the message gives both sizes."""


def expanded_nodes(root: yaml.Node, limit: int) -> tuple[int, int]:
    """``(expanded, distinct)``: how many nodes the document rooted at ``root`` holds with
    every alias expanded, and how many distinct nodes it has. Stops (raises
    :class:`AliasBombError`) as soon as ``expanded - distinct`` passes ``limit`` or a node
    is found inside itself. Iterative: a deeply nested document does not hit Python's
    recursion limit."""
    size: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    expanded = 0
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            on_path.discard(key)
            total = 1 + sum(size[id(c)] for c in _children(node))
            size[key] = total
            continue
        if key in size:
            continue
        if key in on_path:
            raise AliasBombError(None, None, "an alias refers to a node that contains it "
                                 "(a recursive document)", root.start_mark)
        on_path.add(key)
        stack.append((node, True))
        for child in _children(node):
            ckey = id(child)
            if ckey in on_path:
                raise AliasBombError(None, None, "an alias refers to a node that contains "
                                     "it (a recursive document)", root.start_mark)
            if ckey not in size:
                stack.append((child, False))
    expanded = size[id(root)]
    distinct = len(size)
    if expanded - distinct > limit:
        raise AliasBombError(None, None, f"aliases expand this document to {expanded} "
                             f"nodes from {distinct} (more than {limit} added: an alias "
                             f"bomb?)", root.start_mark)
    return expanded, distinct


def _children(node: yaml.Node) -> Iterator[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        yield from node.value
    elif isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            yield k
            yield v


class BoundedLoader(_BASE):
    """The safe loader with each document measured before it is constructed (module
    docstring). ``max_alias_nodes`` may be lowered on a subclass or an instance."""

    max_alias_nodes = MAX_ALIAS_NODES
    strict_keys = False  # True: a key given twice in a mapping raises DuplicateKeyError

    def __init__(self, stream: Any):
        text = stream if isinstance(stream, (str, bytes)) else stream.read()
        if len(text) > MAX_BYTES:
            raise TooLargeError(f"{len(text)} bytes, more than the {MAX_BYTES} a YAML "
                                f"text may have")
        self._may_alias = ("*" in text) if isinstance(text, str) else (b"*" in text)
        super().__init__(text)

    def get_data(self) -> Any:
        node = self.get_node()
        if node is None:
            return None
        if self._may_alias:
            expanded_nodes(node, self.max_alias_nodes)
        return self.construct_document(node)

    def get_single_data(self) -> Any:
        node = self.get_single_node()
        if node is None:
            return None
        if self._may_alias:
            expanded_nodes(node, self.max_alias_nodes)
        return self.construct_document(node)

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict:
        """The safe constructor's mapping; with :attr:`strict_keys`, raises
        :class:`DuplicateKeyError` for a key the mapping gives twice. Checked here, while
        constructing, rather than by a second walk of the node graph: the constructed
        dict has fewer entries than the node has pairs only when a key repeats (or a
        ``<<`` merge supplied keys, which may be overridden: those mappings are checked
        pair by pair)."""
        if not self.strict_keys or not isinstance(node, yaml.MappingNode):
            return super().construct_mapping(node, deep)
        own = list(node.value)  # before the safe constructor flattens ``<<`` merges
        mapping = super().construct_mapping(node, deep)
        if len(mapping) != len(own) or len(node.value) != len(own):
            _check_own_keys(own)
        return mapping


class DuplicateKeyError(yaml.MarkedYAMLError):
    """A mapping that gives the same key twice (``strict_keys``: settings files and the
    files source, where the second value winning unseen is a typo's doing, and which
    kubectl and ztunnel refuse too); ``problem`` names the key and the line of its first
    occurrence, ``problem_mark`` the second."""


_MERGE = "tag:yaml.org,2002:merge"


def _check_own_keys(pairs: list[tuple[yaml.Node, yaml.Node]]) -> None:
    """Raise :class:`DuplicateKeyError` for the first scalar key among ``pairs`` (one
    mapping's own pairs, ``<<`` merges excluded) that an earlier pair gave; no error when
    none repeats (a merge accounted for the difference)."""
    keys: dict[tuple[str, str], yaml.Node] = {}
    for key, _ in pairs:
        if not isinstance(key, yaml.ScalarNode) or key.tag == _MERGE:
            continue
        first = keys.get((key.tag, key.value))
        if first is not None:
            raise DuplicateKeyError(
                problem=f"key {short_repr(key.value)} given twice (first at line "
                        f"{first.start_mark.line + 1})",
                problem_mark=key.start_mark)
        keys[(key.tag, key.value)] = key


def load(text: str | bytes, strict_keys: bool = False) -> Any:
    """One document (None for an empty text). Raises ``yaml.YAMLError`` (syntax, several
    documents, :class:`AliasBombError`, :class:`TooLargeError`, and with ``strict_keys``
    :class:`DuplicateKeyError`)."""
    loader = BoundedLoader(text)
    loader.strict_keys = strict_keys
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


_REPR = reprlib.Repr()
_REPR.maxlevel = 3
_REPR.maxdict = _REPR.maxlist = _REPR.maxtuple = _REPR.maxset = 6
_REPR.maxstring = _REPR.maxother = 80
_REPR.maxlong = 40


def short_repr(value: Any, limit: int = MAX_LOGGED) -> str:
    """``repr(value)`` cut to about ``limit`` characters without ever building the whole
    string (nested containers are elided with ``...``)."""
    text = _REPR.repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def short_text(text: str, limit: int = MAX_LOGGED * 5) -> str:
    """``text`` cut to ``limit`` characters, saying how much was left out."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"
