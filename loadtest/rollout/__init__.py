"""The rollout benchmark: a rolling update of vLLM replicas under streaming load, with and without the
picker, as tables and a timeline picture (`python -m loadtest.rollout`, `make rollout`).

Modules: `load` (seeded open-loop Poisson arrivals and what each client saw), `fleet` (one simulator
or, with `--real-vllm`, one real vLLM CPU server per replica, its state history and /metrics samples),
`attribution` (which replica answered, when the replica does not say: Envoy's access log, /metrics),
`setups` (the two pools and how each takes a replica out),
`rolling` (the maxSurge/maxUnavailable controller and one run), `report` (tables), `timeline` (the
picture, drawable from any list of events: `picker demo` reuses it), `pd` (a prefill / decode pool's
rollout: roles and revisions, its setups, pairs and pulls from the simulators' books;
`python -m loadtest.bench_rollout_pd`).
"""
