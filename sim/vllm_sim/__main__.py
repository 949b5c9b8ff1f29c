"""`python -m vllm_sim --port P [--port P2 ...] [options]` (see --help)."""

import sys

from vllm_sim.cli import main

sys.exit(main())
