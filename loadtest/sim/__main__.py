"""`python -m loadtest.sim --port P [--port P2 ...] [options]` (see --help)."""

import sys

from loadtest.sim.cli import main

sys.exit(main())
