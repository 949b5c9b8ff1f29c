"""Who writes the pool pods' pod-deletion-cost annotation: the leader, else the first of the linked
peers by name, else the lone picker; a writer that stands down forgets what it wrote."""

from __future__ import annotations

from picker.peers.books import Peering
from picker.pool import Pool
from picker.pool.deletion_cost import CostPolicy, PodRef
from picker.pool.deletion_rank import RankPolicy
from picker.sources.deletion_cost import DeletionCostWriter, writer_gate


def test_the_leader_alone_writes_when_leader_election_runs() -> None:
    leading = [False]
    gate = writer_gate(lambda: leading[0], Peering("10.0.0.1:9004", ("10.0.0.2:9004",), Pool()))
    assert not gate()
    leading[0] = True
    assert gate()


def test_among_peers_the_first_linked_name_writes() -> None:
    a = Peering("10.0.0.1:9004", ("10.0.0.1:9004", "10.0.0.2:9004"), Pool())
    b = Peering("10.0.0.2:9004", ("10.0.0.1:9004", "10.0.0.2:9004"), Pool())
    for one, other in ((a, b), (b, a)):
        one.connected, one.heard = {other.name}, {other.name}
    assert writer_gate(None, a)() and not writer_gate(None, b)()
    b.connected = set()  # b cannot reach a (a partition, a's restart): it writes too, bounded
    assert writer_gate(None, b)()
    assert writer_gate(None, None)()  # alone


class Patcher:
    namespace = "ns"

    def __init__(self) -> None:
        self.written: list[tuple[str, int]] = []

    async def may_patch(self, namespace: str) -> tuple[bool, str]:
        return True, ""

    async def annotate(self, pod: PodRef, value: int) -> None:
        self.written.append((pod.name, value))

    async def aclose(self) -> None:
        pass


async def test_a_writer_that_stands_down_forgets_and_the_next_starts_from_the_pods() -> None:
    writing = [True]
    patcher = Patcher()
    pods = [PodRef("ns", "a", ("a:1",)), PodRef("ns", "b", ("b:1",))]
    writer = DeletionCostWriter(
        patcher,
        lambda: pods,
        lambda: [],
        Pool(),
        CostPolicy(100, 0.05, 0.1, 0.0),
        RankPolicy(10.0, 1.0, 0.1, 20),
        step_s=1.0,
        writing=lambda: writing[0],
        clock=lambda: 0.0,
    )
    assert await writer.step() == 2 and writer.figures()[0]
    writing[0] = False
    assert await writer.step() == 0 and writer.skipped["standby"] == 1
    assert writer.ranker.written == {} and not writer.figures()[0]
    pods = [PodRef("ns", "a", ("a:1",), value=0), PodRef("ns", "b", ("b:1",), value=1000)]
    writing[0] = True
    assert await writer.step() == 0  # what the pods say already holds
