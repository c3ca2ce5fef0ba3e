"""Errors the CLI turns into one line for the operator (no traceback).

Kept in a module of its own, free of heavy imports, so the CLI can catch them without
loading the daemon.
"""

from __future__ import annotations


class ComponentStartError(RuntimeError):
    """A component's ``start`` failed (port in use, unusable path, ...).

    ``component`` names it, ``error`` is the original exception; ``str()`` is one line
    for the operator: ``"<component>: <reason>"``.
    """

    def __init__(self, component: str, error: BaseException):
        self.component, self.error = component, error
        super().__init__(f"{component}: {str(error) or type(error).__name__}")
