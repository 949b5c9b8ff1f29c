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


# One rerun per check of this tier, and only here. A real vLLM on this 2-core VM shares it with
# everything else, and the VM itself stalls at times (a bare sleep loop saw 3 s gaps; a connect to a
# draining vLLM once got no answer for 15 s, and once every request for 86 s): a check that fails
# twice in a row fails the run. The simulator's tiers, which carry the picker's own guarantees, get
# no rerun.
RERUNS = 1


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tier's checks for one rerun; skip them all, with the reason, when vLLM is not
    installed or skipping was asked for."""
    reason = launcher.skip_reason()
    for item in items:
        if TIER_DIR not in Path(item.path).parents:
            continue
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
        else:
            item.add_marker(pytest.mark.flaky(reruns=RERUNS))


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
