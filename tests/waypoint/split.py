"""A weighted split checked over real requests, without a chance failure per run.

The issue's figure is an 80/20 split over 200 requests landing within ±8 points. Envoy
picks each request's (or connection's) cluster at random, so a correct 80/20 split falls
outside that band about once in 200 runs (±16 of 200 is 2.8 standard deviations): with a
few such tests, a CI run in a hundred failed on chance alone (a fresh run saw 142 of
200). :func:`check_split` keeps the figure and removes the chance: when the first 200
fall outside the band, 800 more are drawn and all 1,000 must land within ±4 points
(3.2 standard deviations of 1,000), which a wrong weight (70/30, 90/10) still fails.
"""

from __future__ import annotations

from typing import Awaitable, Callable

FIRST, MORE = 200, 800


async def check_split(draw: Callable[[int], Awaitable[list[str]]], heavy: str,
                      light: str, share: float = 0.8) -> dict[str, int]:
    """``draw(n)``: ``n`` requests' answers (each ``heavy`` or ``light``). Returns the
    counts; AssertionError when the split is not ``share``/``1 - share`` as above, or an
    answer is neither backend."""
    answers = await draw(FIRST)
    counts = _counts(answers, heavy, light)
    if abs(counts[heavy] - share * FIRST) <= 0.08 * FIRST:
        return counts
    answers += await draw(MORE)
    total = _counts(answers, heavy, light)
    n = FIRST + MORE
    assert abs(total[heavy] - share * n) <= 0.04 * n, (
        f"{heavy}/{light} split: first {FIRST}: {counts}, all {n}: {total} "
        f"(expected {share:.0%} of them on {heavy})")
    return total


def _counts(answers: list[str], heavy: str, light: str) -> dict[str, int]:
    counts = {heavy: answers.count(heavy), light: answers.count(light)}
    assert counts[heavy] + counts[light] == len(answers), answers
    return counts
