"""One stack per frontend: Envoy + `picker serve`, or `picker proxy` alone, on the same simulators.

The guarantees that do not depend on who carries the bytes are written once, against `stack`, and run
against both frontends.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.proxy_stack import ProxyStack
from loadtest.stack import Stack, StackOptions

FRONTENDS = ("envoy", "proxy")
FAST = ("--ttft-ms", "5", "--itl-ms", "10")


def start_stack(frontend: str, workdir: Path, options: StackOptions) -> Stack:
    """Replicas + the given frontend, started and answering."""
    kind = ProxyStack if frontend == "proxy" else Stack
    return kind(workdir, options).start()


@pytest.fixture(scope="module", params=FRONTENDS)
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    frontend = str(request.param)
    options = StackOptions(replicas=2, sim_args=FAST, picker_args=("--no-scrape",))
    stack = start_stack(frontend, tmp_path_factory.mktemp(frontend), options)
    try:
        yield stack
    finally:
        stack.stop()
