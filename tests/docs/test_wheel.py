"""What `pip install` gives: the picker's wheel holds the picker alone (no simulator, no benchmark, no
harness in a user's site-packages), and the simulator is a distribution of its own that installs and
serves without the picker's repository around it."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from loadtest import http_client
from loadtest.procs import Proc, free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]
BUILD_S = 300  # a wheel build resolves its build backend first: bounded, not timed


def build(project: Path, out: Path) -> Path:
    run = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(project)],
        capture_output=True,
        text=True,
        timeout=BUILD_S,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    (wheel,) = out.glob("*.whl")
    return wheel


@pytest.mark.timeout(BUILD_S + 60)
def test_the_picker_wheel_holds_the_picker_alone(tmp_path: Path) -> None:
    wheel = build(ROOT, tmp_path)
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert tops == {"picker", wheel.name.split("-")[0] + "-0.1.0.dist-info"}, tops
    names = zipfile.ZipFile(wheel).namelist()
    assert "picker/admin/static/status.js" in names  # its own data files do go with it


@pytest.mark.timeout(BUILD_S + 60)
def test_the_simulator_installs_and_serves_on_its_own(tmp_path: Path) -> None:
    wheel = build(ROOT / "sim", tmp_path / "wheel")
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert "vllm_sim" in tops and not {"picker", "loadtest"} & tops, tops
    target = tmp_path / "site"
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target", str(target), str(wheel)],
        capture_output=True,
        text=True,
        timeout=BUILD_S,
    )
    assert installed.returncode == 0, installed.stderr[-2000:]
    # from a folder with neither the repository nor its harness on the path: the wheel alone
    env = {**os.environ, "PYTHONPATH": str(target)}
    where = subprocess.run(
        [sys.executable, "-c", "import vllm_sim, sys; print(vllm_sim.__file__, 'loadtest' in sys.modules)"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
    )
    assert where.stdout.split() == [str(target / "vllm_sim" / "__init__.py"), "False"], where
    port = free_port()
    argv = [sys.executable, "-m", "vllm_sim", "--port", str(port)]
    proc = Proc("vllm-sim", argv, tmp_path / "sim.log", env=env, cwd=tmp_path)
    try:
        wait_until(lambda: _healthy(port), 30)
        answer = http_client.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": "tiny-llama", "prompt": "hi", "max_tokens": 3},
            timeout=10,
        )
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3, answer.text
    finally:
        proc.stop()


def _healthy(port: int) -> bool:
    try:
        return http_client.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except Exception:
        return False
