""":func:`tests.waypoint.split.check_split` itself: a chance outlier of a right split
passes on the larger draw, a wrong weight fails either way."""

import random

import pytest

from tests.waypoint.split import check_split


def drawer(share: float, first: int | None = None, seed: int = 7):
    rng = random.Random(seed)
    calls = []

    async def draw(n: int) -> list[str]:
        calls.append(n)
        if first is not None and len(calls) == 1:  # a fixed first draw: the outlier
            return ["v1"] * first + ["v2"] * (n - first)
        return ["v1" if rng.random() < share else "v2" for _ in range(n)]
    return draw, calls


async def test_in_band_first_draw_is_enough():
    draw, calls = drawer(0.8, first=160)
    assert await check_split(draw, "v1", "v2") == {"v1": 160, "v2": 40}
    assert calls == [200]


async def test_chance_outlier_of_a_right_split_passes_on_1000():
    draw, calls = drawer(0.8, first=142)  # what a CI run saw
    counts = await check_split(draw, "v1", "v2")
    assert calls == [200, 800] and sum(counts.values()) == 1000


@pytest.mark.parametrize("share", [0.7, 0.9])
async def test_wrong_weight_fails(share):
    draw, _ = drawer(share, first=int(share * 200))
    with pytest.raises(AssertionError, match="split"):
        await check_split(draw, "v1", "v2")


async def test_unknown_answer_fails():
    async def draw(n: int) -> list[str]:
        return ["v1"] * (n - 1) + ["v3"]
    with pytest.raises(AssertionError):
        await check_split(draw, "v1", "v2")
