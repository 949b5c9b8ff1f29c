"""Fixtures for the realvllm tier: a real vLLM (CPU build) serving the tiny local model.

Each vLLM start costs ~25 s and ~2 GB on a 2-core box, so the non-destructive checks share one
class-scoped server and only the drain check starts its own; the two never run at the same time.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.realvllm import launcher

TIER_DIR = Path(__file__).resolve().parent

# test_parity imports tests.sim.parity_checks: make the project root importable even when pytest is not
# started from it (`python -m pytest` from the root already has it on sys.path).
if str(launcher.PROJECT_ROOT) not in sys.path:
    sys.path.insert(0, str(launcher.PROJECT_ROOT))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the whole tier, with the reason, when vLLM is not installed or skipping was asked for."""
    reason = launcher.skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if TIER_DIR in Path(item.path).parents:
            item.add_marker(skip)


@pytest.fixture(scope="class")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[launcher.RealVllm]:
    """One real vLLM for a class of checks that leave it healthy (default shutdown mode)."""
    workdir = tmp_path_factory.mktemp("realvllm-shared")
    with launcher.real_vllm(launcher.free_port(), workdir) as server:
        yield server


@pytest.fixture
def vllm_workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh folder for a server a test starts itself (log, sockets, caches)."""
    return tmp_path_factory.mktemp("realvllm-own")
