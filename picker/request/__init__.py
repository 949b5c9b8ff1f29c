"""The request path: one request from its arrival to its recorded end, in the core.

Owns `RequestPath` (`pipeline.py`: view -> admit -> pick -> track -> release), where it goes
(`placement.py`: cache keys, affinity and the latency model's pick), how it is followed to its end
(`tracking.py`) and what is read from it (`inference.py`: the OpenAI body; `hints.py`: the routing
hint headers; `objectives.py`: InferenceObjective priorities). Core: imports the planes below it
(flow, scheduling, streams, pool), the contract, the configuration model and the observability
hooks; no network I/O, no frontend.
"""
