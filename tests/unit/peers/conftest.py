"""Two pickers' peer sides (tests/unit/peers/test_peer_links.py `Side`), closed after each test."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.unit.peers.test_peer_links import Side


@pytest.fixture
async def sides() -> AsyncIterator[list[Side]]:
    made = [Side(), Side()]
    yield made
    for side in made:
        await side.close()
