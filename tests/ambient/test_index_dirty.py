"""ambient/index_base.py ``Dirty.reset``: every field back to its default, every set a new
(small) one."""

from __future__ import annotations

import dataclasses

from ambient.index_base import Dirty


def test_reset_restores_every_field_with_fresh_sets():
    d = Dirty()
    for f in dataclasses.fields(d):
        value = getattr(d, f.name)
        if isinstance(value, bool):
            setattr(d, f.name, True)
        else:
            value.update({("ns", f"x{i}") for i in range(1000)})
    before = {f.name: getattr(d, f.name) for f in dataclasses.fields(d)}
    d.reset()
    assert d == Dirty()
    for f in dataclasses.fields(d):
        if isinstance(before[f.name], set):
            assert getattr(d, f.name) is not before[f.name], f.name  # not the grown table
