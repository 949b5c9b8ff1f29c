"""The drain scorecard: rows from drain records, the unused grace, the table and the JSON."""

from __future__ import annotations

import argparse
import json

import pytest

from picker.drain import scorecard
from picker.pool.drain import DrainCause, DrainEnd, DrainExit, DrainRecord


def record(in_flight: int = 3) -> DrainRecord:
    drain = DrainRecord(
        address="10.0.0.7:8000",
        cause=DrainCause.SOURCE,
        source="kube",
        started_at=100.0,
        started_wall=1_800_000_000.0,
        in_flight_at_start=in_flight,
    )
    for _ in range(2):
        drain.request_ended(DrainEnd.COMPLETED, 1, 101.0)
    drain.request_ended(DrainEnd.CLIENT_DISCONNECT, 0, 104.5)
    drain.close(DrainExit.GONE, 106.0)
    return drain


def test_rows_carry_the_true_numbers_and_unused_grace() -> None:
    (row,) = scorecard.score([record().summary(110.0)], grace_s=30.0)
    assert row["endpoint"] == "10.0.0.7:8000" and row["in_flight_at_start"] == 3
    assert row["completed"] == 2 and row["ended"]["client-disconnect"] == 1
    assert row["time_to_zero_s"] == 4.5 and row["unused_grace_s"] == 25.5
    assert row["picks_after_start"] == 0 and row["forced_cuts"] == 0 and row["exit"] == "gone"


def test_without_grace_the_unused_grace_is_unknown() -> None:
    assert scorecard.score([record().summary(110.0)], grace_s=None)[0]["unused_grace_s"] is None


def test_table_has_one_line_per_drain_and_a_header() -> None:
    text = scorecard.table(scorecard.score([record().summary(110.0), record(0).summary(110.0)], 30.0))
    lines = text.splitlines()
    assert len(lines) == 3 and lines[0].startswith("endpoint")
    assert "10.0.0.7:8000" in lines[1] and "25.5" in lines[1]
    assert scorecard.table([]) == "no drains recorded yet"


def test_main_prints_json_from_a_picker(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(scorecard, "fetch", lambda url, timeout_s=5.0: [record().summary(110.0)])
    assert scorecard.main(argparse.Namespace(url="http://x", grace=10.0, json=True)) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["unused_grace_s"] == 5.5


def test_unreachable_picker_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert scorecard.main(argparse.Namespace(url="http://127.0.0.1:1", grace=None, json=False)) == 2
    assert "cannot read drains" in capsys.readouterr().err
