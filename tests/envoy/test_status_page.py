"""The live status page (`/status` on the admin port) in a real browser, during a simulated rollout
through the real Envoy (issue 41).

Headless Chromium (Debian's package; `make test` installs it as it does promtool) loads the page over
two stable replicas and a candidate under a closed loop of streams, and the test reads the page's DOM
as the picker's state changes: a lane per replica with its streams, the canary stepping from 10 % to
50 %, a replica drained by the admin API turning `draining` and its stream count falling to 0. The
actions need the token and a confirmation. Screenshots (wide and phone) are saved with the test's
files; `SCREENSHOTS_TO_DOCS=1` also writes them to docs/img/ for the rollouts guide.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
from pathlib import Path

import pytest

from loadtest import http_client
from loadtest.browser import Browser, chromium_binary
from loadtest.rollout.canary import STABLE_SIM, CanaryStack
from loadtest.traffic import run_closed_loop

pytestmark = [
    pytest.mark.envoy,
    pytest.mark.skipif(chromium_binary() is None, reason="no Chromium installed (make test installs it)"),
]

DOCS_IMG = Path(__file__).resolve().parents[2] / "docs" / "img"
ROLLOUT = {
    "steps": [10, 50, 100],
    "step_interval_s": 2.0,
    "step_min_requests": 60,
    "window_s": 5,
    "min_samples": 8,
    "latency_floor_s": 0.1,
}


def lane(address: str, part: str) -> str:
    """A JavaScript expression: the text of one part of a replica's lane ('' if absent)."""
    return f"(document.querySelector('.lane[data-address=\"{address}\"] {part}')?.textContent ?? '')"


def lane_state(address: str) -> str:
    return f"(document.querySelector('.lane[data-address=\"{address}\"]')?.dataset.state ?? '')"


async def test_the_page_follows_a_rollout_and_a_drain_as_they_happen(tmp_path: Path) -> None:
    canary = CanaryStack(tmp_path, "envoy", STABLE_SIM, ROLLOUT)
    canary.start()
    shots: list[Path] = []
    try:
        admin = f"http://127.0.0.1:{canary.stack.metrics_port}"
        drained = canary.stack.replicas[0]
        traffic = asyncio.create_task(
            run_closed_loop(
                canary.stack.url,
                concurrency=12,
                max_requests=3000,
                deadline_s=40,
                max_tokens=150,
                tokens_spread=120,
            )
        )
        async with Browser(tmp_path) as page:
            await page.goto(f"{admin}/status")
            assert await page.wait_for("document.querySelectorAll('.lane').length === 3", 10, "three lanes")
            assert await page.evaluate(lane(canary.candidate, ".tag")) == "candidate"
            await page.wait_for("document.getElementById('canary-weight')?.textContent === '10%'", 10, "10 %")
            # a gate that waits says why (issue 54): what it needs and has, and whether it can come
            await page.wait_for(
                "[...document.querySelectorAll('#gates td[data-why=\"1\"]')]"
                ".some(td => /^waits: (candidate|stable) has \\d+ of 8 samples/.test(td.textContent))",
                10,
                "a waiting gate's reason",
            )
            await page.wait_for(f"Number({lane(drained, '.in-flight')}) > 0", 15, "streams on a stable lane")

            async with http_client.AsyncClient(timeout=10) as client:
                answer = await client.post(f"{admin}/admin/endpoints/{drained}/drain?force=true")
                assert answer.status_code == 200, answer.text
            await page.wait_for(f"{lane_state(drained)} === 'draining'", 5, "the lane turn draining")
            shots.append(await page.screenshot(tmp_path / "status-page.png"))
            waiting = await page.evaluate(lane(drained, ".drain"))
            assert "streams still running" in waiting and "picks after start 0" in waiting, waiting
            await page.wait_for(f"{lane(drained, '.in-flight')} === '0'", 20, "the drained lane at 0 streams")
            print("drained lane at zero:", await page.evaluate(lane(drained, "")))
            await page.wait_for(
                "document.getElementById('canary-weight')?.textContent === '50%'",
                30,
                "the canary's next step",
            )

            # actions: hidden until the token is entered, and each asks first (declined here)
            assert await page.evaluate(
                "getComputedStyle(document.querySelector('.lane .actions')).display"
            ) == ("none")
            await page.evaluate("document.getElementById('token').value = 't'")
            await page.evaluate("document.getElementById('unlock-button').click()")
            await page.evaluate("window.confirm = () => false")
            await page.evaluate(
                "[...document.querySelectorAll('button')].find(b => b.textContent === 'Abort').click()"
            )
            assert (await asyncio.to_thread(canary.rollout))[
                "phase"
            ] != "rolled-back"  # declined: nothing sent

            await page.emulate_phone()
            shots.append(await page.screenshot(tmp_path / "status-page-phone.png"))
            overflow = await page.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1")
            assert overflow, "the page scrolls sideways on a phone"
        traffic.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await traffic
    finally:
        canary.stop()
    assert all(shot.stat().st_size > 10_000 for shot in shots)
    if os.environ.get("SCREENSHOTS_TO_DOCS") == "1":
        for shot in shots:
            shutil.copy(shot, DOCS_IMG / shot.name)
