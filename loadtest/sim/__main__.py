"""`python -m loadtest.sim`: the simulator's former name (`python -m vllm_sim`)."""

import sys

from vllm_sim.cli import main

sys.exit(main())
