"""`picker demo --proxy` runs end to end and reports a clean drain and a clean deadline cut."""

from __future__ import annotations

import pytest

from picker.cli.demo_proxy import run_demo_proxy


async def test_demo_proxy_drains_and_cuts_cleanly(capsys: pytest.CaptureFixture[str]) -> None:
    assert await run_demo_proxy(seconds=3.0) == 0
    out = capsys.readouterr().out
    assert "new picks after start     0" in out
    assert "failed or incomplete streams: 0" in out
    assert out.count("then an error event (reason rejected-shutting-down) and [DONE]") == 4
    assert "cut_at_deadline=4" in out
