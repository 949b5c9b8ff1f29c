"""`picker demo` reports what it measured about the drain, not what it expects."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from loadtest.rollout.load import LoadReport, Outcome
from loadtest.rollout.timeline import mark_event, state_event
from loadtest.sse_client import DONE, SseEvent, StreamResult
from loadtest.traffic import REPLICA_HEADER, Report, Result
from picker.cli.demo import _as_report, draw_rollout, print_drain_outcome

OK = {"status": 200, "done": True, "finish_reason": "length"}


def test_a_clean_drain_is_reported_as_measured(capsys: pytest.CaptureFixture[str]) -> None:
    report = Report([Result(replica="c:1", **OK), Result(replica="a:1", **OK)])  # type: ignore[arg-type]
    print_drain_outcome(report, "c:1", {"a:1": 5, "b:1": 0, "c:1": 0})
    out = capsys.readouterr().out
    assert "streams served by c:1: 1, cut or failed: 0" in out
    assert "new requests went only to a:1\n" in out  # b:1 got none: not named


def test_cuts_and_late_arrivals_are_reported(capsys: pytest.CaptureFixture[str]) -> None:
    cut = Result(replica="c:1", status=200, done=False, error="reset")
    report = Report([cut, Result(replica="c:1", **OK)])  # type: ignore[arg-type]
    print_drain_outcome(report, "c:1", {"a:1": 5, "b:1": 4, "c:1": 2})
    out = capsys.readouterr().out
    assert "streams served by c:1: 2, cut or failed: 1" in out
    assert "c:1 still got 2 new requests after its drain began" in out
    assert "went only to" not in out


def _load_report() -> LoadReport:
    """Two streams as a client saw them: one completed on a:1, one cut on c:1 (a drained replica)."""
    done = StreamResult(status=200, headers={REPLICA_HEADER: "a:1"}, end="done", t_headers=0.05, t_end=0.6)
    done.events = [SseEvent('{"choices":[{"text":"x","finish_reason":"length"}]}', 0.05), SseEvent(DONE, 0.6)]
    cut = StreamResult(status=200, headers={REPLICA_HEADER: "c:1"}, end="eof", t_headers=0.05, t_end=0.3)
    return LoadReport([Outcome(0.1, done), Outcome(0.2, cut)], wall_s=1.0)


def test_the_replayed_outcomes_print_with_one_classification() -> None:
    report = _as_report(_load_report())
    assert [(r.replica, r.ok) for r in report.results] == [("a:1", True), ("c:1", False)]
    assert report.failures()[0].error == "truncated" and report.ttfts() == [report.results[0].ttft_s]


def test_the_rollout_picture_is_a_png_with_the_drain_on_the_traffic_clock(tmp_path: Path) -> None:
    drain = [mark_event(0.25, "c:1", "router told"), state_event(0.3, "c:1", "draining")]
    drawn = draw_rollout(tmp_path / "r.png", ["a:1", "b:1", "c:1"], "c:1", _load_report(), drain)
    assert drawn == tmp_path / "r.png" and drawn.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_matplotlib_the_demo_says_so_and_draws_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a)
    )
    assert draw_rollout(tmp_path / "r.png", ["a:1"], "a:1", _load_report(), []) is None
    assert "matplotlib is not installed" in capsys.readouterr().out and not (tmp_path / "r.png").exists()
