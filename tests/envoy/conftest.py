"""Fixtures for tests that go through the real Envoy binary, the picker and simulated replicas."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from loadtest.stack import Stack, StackOptions
from tests.kube.conftest import fake  # noqa: F401 (the fake API server, for the leader election tests)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = Stack(tmp_path_factory.mktemp("stack"), StackOptions(replicas=3)).start()
    try:
        yield stack
    finally:
        stack.stop()


@pytest.fixture
def clean_stack(stack: Stack) -> Iterator[Stack]:
    """The shared stack, checked for in-flight leaks after the test."""
    yield stack
    stack.wait_no_leaks()
