"""Every test here leaves no temp dir behind, pass or fail."""

from __future__ import annotations

import pytest

from tests.zds.helpers import remove_short_dirs


@pytest.fixture(autouse=True)
def _remove_short_dirs():
    yield
    remove_short_dirs()
