"""The process's life: start-up checks worded for the operator (`startup.py`) and the graceful
shutdown sequence, one budget spent in named phases (`shutdown.py`); with `--workers N`, the parent
that runs N pickers in one pod and forwards their signals (`workers.py`). Imported by the assembly
(`picker/app.py`, `picker/wiring.py`) and the command line."""
