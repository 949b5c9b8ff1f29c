import random
from collections import Counter
from dataclasses import dataclass

from picker.scheduling import pick


@dataclass
class Cand:
    address: str
    in_flight: int
    peer_in_flight: int = 0
    superseded: int = 0


def test_least_in_flight_first_then_fallbacks_in_order() -> None:
    cands = [Cand("a", 5), Cand("b", 1), Cand("c", 3)]
    assert pick(cands, 3, random.Random(1)) == ["b", "c", "a"]
    assert pick(cands, 2, random.Random(1)) == ["b", "c"]


def test_count_larger_than_candidates_lists_each_once() -> None:
    assert sorted(pick([Cand("a", 0), Cand("b", 0)], 5, random.Random(0))) == ["a", "b"]


def test_nothing_to_pick() -> None:
    assert pick([], 3, random.Random(0)) == []
    assert pick([Cand("a", 0)], 0, random.Random(0)) == []


def test_ties_are_broken_at_random() -> None:
    rng = random.Random(7)
    firsts = Counter(pick([Cand("a", 0), Cand("b", 0), Cand("c", 0)], 1, rng)[0] for _ in range(3000))
    assert set(firsts) == {"a", "b", "c"}
    assert min(firsts.values()) > 800
