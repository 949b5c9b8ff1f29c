"""Load-testing tools for inference-picker.

- `loadtest.sim`: a vLLM-compatible model-server simulator (`python -m loadtest.sim --help`).
- `loadtest.sse_client`: a small httpx streaming client that records SSE events with timings; shared by
  the simulator's and the picker's tests.
- `loadtest.bench_sim`: how many concurrent streams one simulator process sustains with accurate timing.
- `loadtest.realvllm`: a real vLLM (CPU build) for the parity test tier.
"""
