"""agent.core.gcpause: the collector is off inside, restored after, also on errors, and
left off when it was off before."""

import gc

import pytest

from agent.core import gcpause


def test_paused_disables_and_restores_even_on_error():
    assert gc.isenabled()
    with gcpause.paused():
        assert not gc.isenabled()
        with gcpause.paused():  # nested: the inner exit must not re-enable
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ValueError), gcpause.paused():
        raise ValueError("boom")
    assert gc.isenabled()


def test_paused_leaves_a_disabled_collector_disabled():
    gc.disable()
    try:
        with gcpause.paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_what_the_step_made_is_old_and_nothing_stays_frozen():
    gc.collect()
    with gcpause.paused():
        made = [{"n": [i]} for i in range(20_000)]
        assert gc.get_count()[0] >= 20_000  # young, as the collector was off
    assert gc.get_freeze_count() == 0
    assert gc.get_count()[0] < 1_000  # moved to the oldest generation, not left young
    assert gc.is_tracked(made[0]) and len(made) == 20_000

    class Cycle:
        pass

    with gcpause.paused():
        c = Cycle()
        c.me = c  # cyclic garbage made inside is still collected by a full collection
        del c
    assert gc.collect() >= 1


def test_overlapping_pauses_on_two_threads_end_with_the_last():
    """The imports' pause on a worker thread ending must not turn the collector on under
    the LIST parse's pause on the loop (the order the daemon's cold start makes)."""
    import threading

    inside, leave = threading.Event(), threading.Event()

    def worker():
        with gcpause.paused():
            inside.set()
            leave.wait(10)

    t = threading.Thread(target=worker)
    with gcpause.paused():  # first in: this one saw the collector on
        t.start()
        assert inside.wait(10)
    assert not gc.isenabled()  # the worker's pause still holds it off
    leave.set()
    t.join(10)
    assert gc.isenabled()

    t = threading.Thread(target=worker)
    inside.clear(), leave.clear()
    t.start()
    assert inside.wait(10)
    with gcpause.paused():
        leave.set()
        t.join(10)
        assert not gc.isenabled()  # the worker left first: still off for this body
    assert gc.isenabled()
