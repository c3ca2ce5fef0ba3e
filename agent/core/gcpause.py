"""The cyclic garbage collector paused around one bulk step of the cold path.

CPython runs a collection every ~700 container allocations, and a young-generation pass
walks everything allocated since the last one; a full pass walks the whole heap. Parsing
one 20 MB LIST of 5,000 pods makes ~2 million dicts, lists and strings in one call, so
those passes ran hundreds of times over a growing heap: measured on this project's 5k-pod
cluster, ``json.loads`` of the Pod LIST took 2.0-5.7 s with the collector on and
0.65-0.72 s with it paused (benchmarks/README.md, "Side by side with istiod"). Nothing
made inside a bulk step is garbage until the step ends (the parse result and the index
are kept), so pausing loses nothing; objects freed by reference counting are freed as
always, and the collector runs again as soon as the step ends.

Single-threaded use only matters for the pause's length, not its correctness: another
thread allocating meanwhile is simply not collected until :func:`paused` exits.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Disable the cyclic collector for the ``with`` body if it was on; restore it after
    (also on an exception). Nested use is fine: only the outermost one re-enables."""
    was_on = gc.isenabled()
    if was_on:
        gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()
