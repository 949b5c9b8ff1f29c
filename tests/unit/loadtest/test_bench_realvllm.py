"""bench_realvllm's core pinning (--router-core): a process group's every thread is confined."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.bench_realvllm import group_pids, pin
from loadtest.procs import wait_until

_THREADED = (
    "import threading, time\nfor _ in range(2): threading.Thread(target=time.sleep, args=(60,)).start()\n"
)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pin to one")
def test_pin_confines_every_thread_of_every_process_in_the_group() -> None:
    # a "server" in its own session with a child of its own, each with threads started after launch
    script = _THREADED + f"import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', {_THREADED!r}])\n"
    script += "time.sleep(60)\n"
    server = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    try:
        wait_until(lambda: len(group_pids(server.pid)) == 2, 10, what="the server's child")
        pids = group_pids(server.pid)
        wait_until(
            lambda: all(len(list(Path(f"/proc/{p}/task").iterdir())) == 3 for p in pids),
            10,
            what="every thread to start",
        )
        core = min(os.sched_getaffinity(0))
        pin(pids, {core})
        masks = {
            os.sched_getaffinity(int(t.name)) == {core}
            for p in pids
            for t in Path(f"/proc/{p}/task").iterdir()
        }
        assert masks == {True}
        assert os.getpid() not in pids
    finally:
        os.killpg(server.pid, 9)
        server.wait(5)
