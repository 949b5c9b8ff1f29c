"""The endpoints-file source: the format, atomic replaces, partial writes, rejections, the last good view."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest

from picker.pool import DrainCause, EndpointState, Pool
from picker.sources.static_file import EndpointsFile, EndpointsFileError, parse_endpoints

READY, DRAINING = EndpointState.READY, EndpointState.DRAINING


def test_format_strings_mappings_and_draining() -> None:
    text = "- 10.0.0.1:8000\n- {address: '[fd00::0:1]:8000', draining: true}\n- address: 10.0.0.3:8000\n"
    assert parse_endpoints(text) == {
        "10.0.0.1:8000": READY,
        "[fd00::1]:8000": DRAINING,
        "10.0.0.3:8000": READY,
    }
    assert parse_endpoints("endpoints: [10.0.0.1:8000]") == {"10.0.0.1:8000": READY}
    assert parse_endpoints("[]") == {}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty"),
        ("  \n", "empty"),
        ("- 10.0.0.1:8000\n- {address: 10.0.0.2", "not valid YAML"),
        ("10.0.0.1:8000", "expected a list"),
        ("{servers: []}", "exactly one key"),
        ("- {address: 10.0.0.1:8000, weight: 2}", "unknown keys"),
        ("- {address: 10.0.0.1:8000, draining: 'yes'}", "'draining' must be true or false"),
        ("- {draining: true}", "'address' must be"),
        ("- 10.0.0.1", "entry #0"),
        ("- 10.0.0.1:8000\n- 10.0.0.1:8000", "listed twice"),
        ("- 7", "entry #0"),
    ],
)
def test_invalid_content_says_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(EndpointsFileError, match=message):
        parse_endpoints(text)


def replace_atomically(path: Path, text: str) -> None:
    temp = path.with_suffix(".tmp")
    temp.write_text(text)
    os.replace(temp, path)


def write_in_place(path: Path, text: str, mtime_ns: int) -> None:
    with path.open("r+") as handle:
        handle.truncate(0)
        handle.write(text)
    os.utime(path, ns=(mtime_ns, mtime_ns))  # file systems with coarse mtimes must still see a change


@pytest.fixture
def path(tmp_path: Path) -> Path:
    path = tmp_path / "endpoints.yaml"
    path.write_text("- 10.0.0.1:8000\n- 10.0.0.2:8000\n")
    return path


def state(pool: Pool) -> dict[str, EndpointState]:
    return {e.address: e.state for e in pool.endpoints()}


def test_load_then_atomic_replace_is_applied_at_the_next_check(path: Path) -> None:
    pool = Pool()
    source = EndpointsFile(path, pool, poll_s=1)
    source.load()
    assert state(pool) == {"10.0.0.1:8000": READY, "10.0.0.2:8000": READY} and pool.source == "file"
    assert source.check() is False  # unchanged
    replace_atomically(path, "- 10.0.0.1:8000\n- {address: 10.0.0.2:8000, draining: true}\n")
    assert source.check() is True
    assert state(pool) == {"10.0.0.1:8000": READY, "10.0.0.2:8000": DRAINING}
    record = pool.get("10.0.0.2:8000").drain  # type: ignore[union-attr]
    # the file holds admin drains only (picker/sources/drain_store.py): the record says so
    assert record is not None and record.cause is DrainCause.ADMIN and record.source == "file"
    replace_atomically(path, "- 10.0.0.1:8000\n")
    assert source.check() is True and state(pool) == {"10.0.0.1:8000": READY}
    assert pool.recent_drains()[0].exit is not None


def test_in_place_writes_wait_until_the_file_stops_changing(
    path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pool = Pool()
    source = EndpointsFile(path, pool, poll_s=1)
    source.load()
    base = path.stat().st_mtime_ns
    write_in_place(path, "- 10.0.0.1:8000\n", base + 1_000_000)  # a writer still busy (truncated list)
    with caplog.at_level(logging.INFO):
        assert source.check() is False
    assert "changed in place" in caplog.text
    write_in_place(path, "- 10.0.0.1:8000\n- 10.0.0.2:8000\n- 10.0.0.3:8000\n", base + 2_000_000)
    assert source.check() is False  # it changed again: still settling
    assert len(pool) == 2
    assert source.check() is True  # unchanged for one interval: read it
    assert len(pool) == 3


def test_a_partial_write_is_rejected_once_and_the_last_good_view_stays(
    path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pool = Pool()
    source = EndpointsFile(path, pool, poll_s=1)
    source.load()
    replace_atomically(path, "- 10.0.0.1:8000\n- {address: 10.0.0.3:80")
    with caplog.at_level(logging.ERROR):
        for _ in range(3):
            assert source.check() is False
    rejected = [r.getMessage() for r in caplog.records if "rejected" in r.getMessage()]
    assert len(rejected) == 1
    assert "not valid YAML" in rejected[0] and "keeping the last good view (2 endpoints)" in rejected[0]
    assert state(pool) == {"10.0.0.1:8000": READY, "10.0.0.2:8000": READY}
    replace_atomically(path, "")  # truncated to nothing: the classic partial write
    assert source.check() is False and len(pool) == 2
    replace_atomically(path, "- 10.0.0.3:8000\n")
    assert source.check() is True and state(pool) == {"10.0.0.3:8000": READY}


def test_a_missing_file_keeps_the_view_and_is_picked_up_again(
    path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pool = Pool()
    source = EndpointsFile(path, pool, poll_s=1)
    source.load()
    path.unlink()
    with caplog.at_level(logging.ERROR):
        assert source.check() is False
        assert source.check() is False
    assert sum("cannot read it" in r.getMessage() for r in caplog.records) == 1
    assert len(pool) == 2
    replace_atomically(path, "- 10.0.0.9:8000\n")
    # A new file may reuse the old inode number, and then it counts as changed in place: one more look.
    assert source.check() or source.check()
    assert state(pool) == {"10.0.0.9:8000": READY}


def test_a_bad_file_at_startup_is_an_error_naming_it(path: Path) -> None:
    path.write_text("- nope\n")
    with pytest.raises(EndpointsFileError, match=str(path)):
        EndpointsFile(path, Pool(), poll_s=1).load()
    with pytest.raises(FileNotFoundError):
        EndpointsFile(path.with_name("missing.yaml"), Pool(), poll_s=1).load()


class Stop(BaseException):
    pass


async def test_run_checks_every_interval(path: Path) -> None:
    pool = Pool()
    delays: list[float] = []

    async def sleep(delay: float) -> None:
        delays.append(delay)
        if len(delays) == 1:
            replace_atomically(path, "- 10.0.0.5:8000\n")
        if len(delays) == 3:
            raise Stop

    source = EndpointsFile(path, pool, poll_s=0.25, sleep=sleep)
    source.load()
    with pytest.raises(Stop):
        await source.run()
    assert delays == [0.25, 0.25, 0.25] and state(pool) == {"10.0.0.5:8000": READY} and source.loads == 2


def test_a_deeply_nested_file_is_rejected_and_a_later_valid_one_applied(
    path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pool = Pool()
    source = EndpointsFile(path, pool, poll_s=1)
    source.load()
    replace_atomically(path, "[" * 3000 + "]" * 3000)
    with caplog.at_level(logging.ERROR):
        assert source.check() is False
        assert source.check() is False  # read again (it may be rewritten in place), logged once
    rejected = [r.getMessage() for r in caplog.records if "rejected" in r.getMessage()]
    assert len(rejected) == 1 and "nested too deeply" in rejected[0]
    assert len(pool) == 2
    replace_atomically(path, "- 10.0.0.7:8000\n")
    assert source.check() or source.check()  # a reused inode number counts as changed in place
    assert state(pool) == {"10.0.0.7:8000": READY}


async def test_no_version_of_the_file_ends_the_watch(
    path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Whatever reading one version raises (a parser surprise, a check bug), run() keeps watching."""
    from picker.sources import static_file

    pool = Pool()
    real_read = static_file._read_whole  # what the source parses a version with

    def surprising_read(text: str) -> tuple[tuple[dict[str, EndpointState], static_file.Labels], list[Any]]:
        if "10.0.0.6" in text:
            raise KeyError("surprise")
        return real_read(text)

    monkeypatch.setattr(static_file, "_read_whole", surprising_read)
    versions = ["[" * 3000 + "]" * 3000, "- 10.0.0.6:8000\n", "- 10.0.0.8:8000\n"]
    delays: list[float] = []

    async def sleep(delay: float) -> None:
        # Each version stays for two checks: a new file may reuse the old inode number, and then it
        # counts as changed in place and is read at the second look.
        delays.append(delay)
        if len(delays) > 2 * len(versions):
            raise Stop
        if len(delays) % 2:
            replace_atomically(path, versions[len(delays) // 2])

    source = EndpointsFile(path, pool, poll_s=0.25, sleep=sleep)
    source.load()
    with caplog.at_level(logging.ERROR), pytest.raises(Stop):
        await source.run()
    assert state(pool) == {"10.0.0.8:8000": READY} and source.loads == 2
    assert "KeyError" in caplog.text and "nested too deeply" in caplog.text


def test_labels_are_read_and_checked() -> None:
    from picker.sources.static_file import read_endpoints

    text = "- {address: 10.0.0.1:8000, labels: {app.kubernetes.io/version: v2}}\n- 10.0.0.2:8000\n"
    desired, labels = read_endpoints(text)
    assert desired == {"10.0.0.1:8000": READY, "10.0.0.2:8000": READY}
    assert labels == {"10.0.0.1:8000": {"app.kubernetes.io/version": "v2"}}
    with pytest.raises(EndpointsFileError, match="'labels' must map strings to strings"):
        read_endpoints("- {address: 10.0.0.1:8000, labels: {v: 2}}")


def test_keys_that_are_not_strings_are_named_not_a_crash() -> None:
    """YAML keys may be null or numbers: the unknown keys are named, whatever their type."""
    from picker.sources.static_file import read_endpoints

    with pytest.raises(EndpointsFileError, match=r"unknown keys \['1', 'None', 'extra'\]"):
        read_endpoints("- {address: 10.0.0.1:8000, null: 1, 1: x, extra: y}")


def test_the_pool_carries_each_endpoints_labels() -> None:
    pool = Pool()
    pool.reconcile({"10.0.0.1:8000": READY}, "file", labels={"10.0.0.1:8000": {"v": "2"}})
    endpoint = pool.get("10.0.0.1:8000")
    assert endpoint is not None and endpoint.labels == {"v": "2"}
    pool.reconcile({"10.0.0.1:8000": READY}, "file", labels={})
    assert endpoint.labels is None
