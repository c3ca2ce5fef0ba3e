"""Load kubernetes_asyncio's API and model classes on first use instead of all at import.

``kubernetes_asyncio`` (like the official client it is generated from) imports every API
group class and all ~770 model modules in ``kubernetes_asyncio.client``'s package
``__init__``, and any ``kubernetes_asyncio.*`` import runs that ``__init__`` first (the
top-level package also imports ``dynamic``, which imports jsonschema when
kubernetes-validate is installed). The agent uses a handful of them (``ApiClient``,
``Configuration``, ``ApiException``, the config loaders, ``CoreV1Api`` and friends,
``watch.Watch``), so that import was ~25 % of the agent's start-up import time
(benchmarks/README.md, "Side by side with istiod").

:func:`install` puts light package modules for ``kubernetes_asyncio``,
``kubernetes_asyncio.client``, ``.client.api`` and ``.client.models`` into
``sys.modules`` before anything imports the library. Each resolves a missing attribute
(PEP 562 module ``__getattr__``) by importing the one submodule the library's own
``client/__init__.py`` names for it (read as text: ``from <module> import <Name>``
lines), so ``kclient.CoreV1Api``, ``kubernetes_asyncio.client.models.V1Pod`` (how
``ApiClient`` deserializes) and ``from kubernetes_asyncio import watch`` give the same
objects as an eager import. Submodules load through the packages' real ``__path__``.

``urllib3`` too: ``kubernetes_asyncio.client.configuration`` imports it at the top for
one helper (``urllib3.util.make_headers``, HTTP basic auth, which the agent never uses),
and importing urllib3 (its URL regexes, ``importlib.metadata`` and ``zipfile``) was
40-160 ms of the path to the first LIST. :func:`install` registers a
:class:`_DeferredModule` for it: the module object with its spec, file and path set, whose
body runs on the first access to any other attribute. The standard library's
``importlib.util.LazyLoader`` cannot do this on Python 3.11: an ``import urllib3``
statement reads the module's ``__spec__``, which runs its body there.

Nothing is installed when the library was imported already, is not installed, or its
``__init__`` does not have that shape (a future layout): the eager import then happens
as before. Idempotent; not undoable (call it once, early, in the process that runs the
agent).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import re
import sys
import threading
import types
from typing import Any

PACKAGE = "kubernetes_asyncio"
_FROM_IMPORT = re.compile(r"^from (kubernetes_asyncio\.client\.[\w.]+) import (\w+)\s*$",
                          re.MULTILINE)
_VERSION = re.compile(r"^__version__\s*=\s*[\"']([^\"']+)[\"']", re.MULTILINE)


def _lazy_package(name: str, path: str, names: dict[str, str],
                  version: str = "") -> types.ModuleType:
    """A package module ``name`` over directory ``path`` whose attributes ``names``
    (attribute -> module defining it) and whose submodules are imported on first use."""
    mod = types.ModuleType(name)
    init = os.path.join(path, "__init__.py")
    spec = importlib.machinery.ModuleSpec(name, None, origin=init, is_package=True)
    spec.submodule_search_locations = [path]
    mod.__spec__ = spec
    mod.__path__ = [path]
    mod.__file__ = init
    mod.__package__ = name
    if version:
        mod.__version__ = version  # type: ignore[attr-defined]

    def __getattr__(attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        module = names.get(attr)
        if module is not None:
            value = getattr(importlib.import_module(module), attr)
        else:  # a submodule (``kubernetes_asyncio.watch``, ``client.rest``)
            if not os.path.exists(os.path.join(path, attr)) and \
                    not os.path.exists(os.path.join(path, f"{attr}.py")):
                raise AttributeError(f"module {name!r} has no attribute {attr!r}")
            value = importlib.import_module(f"{name}.{attr}")
        setattr(mod, attr, value)
        return value

    mod.__getattr__ = __getattr__  # type: ignore[method-assign]
    mod.__all__ = sorted(names)  # type: ignore[attr-defined]
    return mod


LAZY_DEPENDENCIES = ("urllib3",)
_DEFERRED_LOCK = threading.RLock()


class _DeferredModule(types.ModuleType):
    """A module whose body has not run yet: :func:`importlib.util.module_from_spec` set
    its ``__spec__``, ``__file__``, ``__path__`` and ``__loader__``; the first lookup of
    any other attribute runs the body into this very object (once, under a lock: another
    thread asking meanwhile waits for it) and from then on it is a plain module. A
    submodule import (``import urllib3.util``) works before that without running it."""

    def __getattr__(self, attr: str) -> Any:
        with _DEFERRED_LOCK:
            if type(self) is _DeferredModule:
                if self.__dict__.get("_ambient_running"):
                    # the body itself asking (``from . import x``) before it set ``attr``
                    raise AttributeError(f"module {self.__name__!r} has no attribute {attr!r}")
                self.__dict__["_ambient_running"] = True
                try:
                    self.__spec__.loader.exec_module(self)  # type: ignore[union-attr]
                except BaseException:
                    sys.modules.pop(self.__name__, None)  # the next import tries afresh
                    raise
                finally:
                    del self.__dict__["_ambient_running"]
                # only now: a thread that found the lock taken waited for the whole body
                self.__class__ = types.ModuleType  # type: ignore[assignment]
        return getattr(self, attr)


def _defer(name: str) -> None:
    """Register top-level module ``name`` as a :class:`_DeferredModule`; nothing when it
    is loaded already, absent, or not loaded from source or bytecode."""
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
        return
    module = importlib.util.module_from_spec(spec)
    module.__class__ = _DeferredModule
    sys.modules[name] = module


def install() -> bool:
    """Install the lazy packages (see the module docstring). Returns whether they are
    in place (False: the library loads eagerly, as without this call)."""
    current = sys.modules.get(PACKAGE)
    if current is not None:
        return getattr(current, "_ambient_lazy", False)
    spec = importlib.util.find_spec(PACKAGE)  # finds, never runs, a top-level package
    if spec is None or not spec.submodule_search_locations:
        return False
    root = list(spec.submodule_search_locations)[0]
    client_dir = os.path.join(root, "client")
    try:
        with open(os.path.join(client_dir, "__init__.py"), encoding="utf-8") as f:
            client_init = f.read()
        with open(os.path.join(root, "__init__.py"), encoding="utf-8") as f:
            top_init = f.read()
    except OSError:
        return False
    names = {attr: module for module, attr in _FROM_IMPORT.findall(client_init)}
    needed = ("ApiClient", "Configuration", "ApiException", "CoreV1Api", "V1Pod")
    if not all(n in names for n in needed):
        return False
    version = (m.group(1) if (m := _VERSION.search(client_init)) else "")
    top_version = (m.group(1) if (m := _VERSION.search(top_init)) else "")

    def under(prefix: str) -> dict[str, str]:
        return {a: m for a, m in names.items() if m.startswith(prefix + ".")}

    top = _lazy_package(PACKAGE, root, {}, top_version)
    top._ambient_lazy = True  # type: ignore[attr-defined]
    client = _lazy_package(f"{PACKAGE}.client", client_dir, names, version)
    api = _lazy_package(f"{PACKAGE}.client.api", os.path.join(client_dir, "api"),
                        under(f"{PACKAGE}.client.api"))
    models = _lazy_package(f"{PACKAGE}.client.models", os.path.join(client_dir, "models"),
                           under(f"{PACKAGE}.client.models"))
    client.api, client.models = api, models  # type: ignore[attr-defined]
    top.client = client  # type: ignore[attr-defined]
    for dependency in LAZY_DEPENDENCIES:
        _defer(dependency)
    sys.modules.update({PACKAGE: top, client.__name__: client, api.__name__: api,
                        models.__name__: models})
    return True
