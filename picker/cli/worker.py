"""One process of `picker serve --workers N`, started by its parent (picker/lifecycle/workers.py).

Its config, the pod's peer credential included, arrives pickled on stdin: never in argv or the
environment, which `ps` and /proc show. Stdin then stays open for the parent's life; at its end (the
parent gone, even SIGKILLed) the worker shuts down as on SIGTERM, so no worker outlives its parent.
Run only by the parent: `python -m picker.cli.worker`.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading

from picker.cli.main import run_serve
from picker.config.model import PickerConfig
from picker.observability.metrics import configure_logging


def _stop_with_parent() -> None:
    """Blocks until the parent's end of stdin closes, then asks this worker to drain and exit."""
    # os.read, not the buffered reader: a daemon thread blocked holding its lock aborts finalization
    while os.read(sys.stdin.fileno(), 4096):
        pass
    os.kill(os.getpid(), signal.SIGTERM)


def main() -> None:
    index, config = pickle.load(sys.stdin.buffer)  # from the parent only
    if not isinstance(index, int) or not isinstance(config, PickerConfig):  # kept under python -O
        raise SystemExit("picker worker: started without its parent's config")
    threading.Thread(target=_stop_with_parent, name="parent-watch", daemon=True).start()
    configure_logging(config.log_level, config.log_format)
    # The parent probed the ports; the ext_proc port is already shared with this worker's siblings.
    run_serve(config)


if __name__ == "__main__":
    main()
