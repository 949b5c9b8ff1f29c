"""Drain tooling for model-server pods and the whole deployment.

- `wait`: the preStop hook `picker drain-wait` (standard library only, also runnable as a copied file).
- `check`: `picker check`, the timing-budget check of Kubernetes manifests and an Envoy bootstrap.
  `manifests` reads YAML with field lines, `workloads` interprets pod specs, `rules` is the catalogue
  of rule ids; `k8s_rules`, `wiring_rules`, `envoy_rules` and `crds` decide where each rule fires.

Nothing here is on the request path; none of it imports a frontend. Synchronous code, no event loop.
"""
