"""Load-testing tools for inference-picker, run from a checkout (never installed).

- `run`: the benchmarks' one runner (`python -m loadtest.run --list`; `make bench ONLY=...`).
- the simulator is its own distribution (sim/, `vllm_sim`), not part of this folder.
- `loadtest.sse_client`: a small httpx streaming client that records SSE events with timings; shared by
  the simulator's and the picker's tests.
- `loadtest.bench_sim`: how many concurrent streams one simulator process sustains with accurate timing.
- `loadtest.realvllm`: a real vLLM (CPU build) for the parity test tier.
"""
