"""Fixtures shared by the transfer tests."""

from __future__ import annotations

import numpy as np
import pytest

from tests.transfer.kvpool import make_pool


@pytest.fixture(scope="module")
def pool() -> list[np.ndarray]:
    """A zeroed pool for one module's reader (each module its own: NIXL reads into these addresses)."""
    return make_pool(None)
