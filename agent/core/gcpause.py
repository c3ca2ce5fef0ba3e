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

What the step made is then moved to the oldest generation in one step (``gc.freeze()``
then ``gc.unfreeze()``: documented as moving every tracked object to the permanent
generation and back into the oldest one), as it would have been after surviving two
collections. Without that, the first allocation after the step ran a young collection
over all 2 million objects at once (~1.3 s of a 5k-pod cold start at load ~20, py-spy;
0.31 s CPU for 400k small dicts in isolation, 0 with the move). They are still walked by
the next full collection, as any long-lived object is; nothing is left frozen.

Pauses on several threads at once are counted: the collector comes back when the last
one ends, so the imports' pause on a worker thread ending cannot turn it on in the middle
of the LIST parse's on the loop. Another thread allocating meanwhile is simply not
collected until then.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from typing import Iterator


_LOCK = threading.Lock()
_holders = 0  # bodies inside paused() now, on any thread
_restore = False  # whether the first of them found the collector on


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Disable the cyclic collector for the ``with`` body if it was on; when the last
    body still inside :func:`paused` on any thread leaves (also on an exception), move
    what is tracked to the oldest generation and re-enable it. Nested and overlapping
    use (the LIST parse on the loop beside the imports on a worker thread) is fine:
    one body leaving never turns the collector back on under another."""
    global _holders, _restore
    with _LOCK:
        if _holders == 0:
            _restore = gc.isenabled()
            gc.disable()
        _holders += 1
    try:
        yield
    finally:
        with _LOCK:
            _holders -= 1
            if _holders == 0 and _restore:
                gc.freeze()
                gc.unfreeze()
                gc.enable()
