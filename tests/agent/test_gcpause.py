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
