from picker.pool import EndpointState, Pool


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_apply_adds_ready_and_draining() -> None:
    pool = Pool()
    pool.apply(ready=["a:1", "b:1"], draining=["c:1"])
    assert sorted(e.address for e in pool.ready()) == ["a:1", "b:1"]
    assert pool.get("c:1").state is EndpointState.DRAINING  # type: ignore[union-attr]


def test_ready_wins_when_a_source_lists_both() -> None:
    pool = Pool()
    pool.apply(ready=["a:1"], draining=["a:1"])
    assert pool.get("a:1").state is EndpointState.READY  # type: ignore[union-attr]


def test_removed_endpoint_without_work_is_forgotten() -> None:
    pool = Pool()
    pool.apply(ready=["a:1", "b:1"])
    pool.apply(ready=["a:1"])
    assert pool.get("b:1") is None


def test_removed_endpoint_keeps_in_flight_until_last_release() -> None:
    clock = FakeClock()
    pool = Pool(clock)
    pool.apply(ready=["a:1", "b:1"])
    first, second = pool.lease("b:1"), pool.lease("b:1")
    clock.now = 105.0
    pool.apply(ready=["a:1"])
    gone = pool.get("b:1")
    assert (
        gone is not None and gone.state is EndpointState.GONE and gone.in_flight == 2 and gone.since == 105.0
    )
    assert [e.address for e in pool.ready()] == ["a:1"]
    first.release()
    assert pool.get("b:1").in_flight == 1  # type: ignore[union-attr]
    second.release()
    assert pool.get("b:1") is None


def test_release_is_idempotent() -> None:
    pool = Pool()
    pool.apply(ready=["a:1"])
    other = pool.lease("a:1")
    lease = pool.lease("a:1")
    lease.release()
    lease.release()
    assert pool.get("a:1").in_flight == 1  # type: ignore[union-attr]
    assert not lease.held and other.held


def test_move_reattributes_to_the_serving_endpoint() -> None:
    pool = Pool()
    pool.apply(ready=["a:1", "b:1"])
    lease = pool.lease("a:1")
    lease.move("b:1")
    assert (pool.get("a:1").in_flight, pool.get("b:1").in_flight) == (0, 1)  # type: ignore[union-attr]
    lease.release()
    assert pool.in_flight() == 0


def test_move_to_an_unlisted_endpoint_tracks_it_as_gone_until_done() -> None:
    pool = Pool()
    pool.apply(ready=["a:1"])
    lease = pool.lease("a:1")
    lease.move("z:9")
    stranger = pool.get("z:9")
    assert stranger is not None and stranger.state is EndpointState.GONE and stranger.in_flight == 1
    assert [e.address for e in pool.ready()] == ["a:1"]
    lease.release()
    assert pool.get("z:9") is None


def test_draining_endpoint_returns_to_ready() -> None:
    pool = Pool()
    pool.apply(ready=[], draining=["a:1"])
    assert pool.ready() == []
    pool.apply(ready=["a:1"])
    assert [e.address for e in pool.ready()] == ["a:1"]
