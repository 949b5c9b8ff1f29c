"""The process's life: start-up checks worded for the operator (`startup.py`) and the graceful
shutdown sequence, one budget spent in named phases (`shutdown.py`). Imported by the assembly
(`picker/app.py`, `picker/wiring.py`) and the command line."""
