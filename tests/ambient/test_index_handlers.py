"""The index's kind -> handler table (``AmbientIndex.handlers``) covers exactly the kinds the
store accepts (``ambient.store.KINDS``): a kind added to the store without a handler would
be stored and silently never reach any output."""

from __future__ import annotations

from ambient.store import KINDS, StoreEvent
from tests.ambient.builders import Harness, pod


def test_every_stored_kind_has_a_handler_and_no_handler_is_for_an_unknown_kind():
    h = Harness()
    assert set(h.index.handlers) == set(KINDS)


def test_an_event_of_a_kind_with_no_handler_changes_nothing():
    h = Harness(pod("a", ip="10.1.0.1"))
    before = h.index.addresses()
    change = h.index.on_events([StoreEvent("Unknown", "ns", "x", None, {"kind": "Unknown"})])
    assert change.empty() and h.index.addresses() == before
