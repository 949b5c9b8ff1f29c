"""Fixtures for `picker proxy` tests: the proxy alone in front of simulated replicas (no Envoy)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from loadtest.proxy_stack import ProxyStack
from loadtest.stack import StackOptions

FAST = ("--ttft-ms", "5", "--itl-ms", "10")
LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyStack]:
    options = StackOptions(replicas=2, sim_args=FAST, picker_args=("--max-body-bytes", str(LIMIT)))
    stack = ProxyStack(tmp_path_factory.mktemp("proxy"), options).start()
    try:
        yield stack
    finally:
        stack.stop()
