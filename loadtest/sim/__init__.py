"""The simulator's former name: it is its own distribution now (sim/, `import vllm_sim`). Kept while
code in flight still says `loadtest.sim`; new code imports `vllm_sim`."""

import importlib
import pkgutil
import sys

import vllm_sim
from vllm_sim import *  # noqa: F403

for _module in pkgutil.iter_modules(vllm_sim.__path__):
    if not _module.name.startswith("_"):
        sys.modules[f"{__name__}.{_module.name}"] = importlib.import_module(f"vllm_sim.{_module.name}")
