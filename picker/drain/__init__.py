"""Drain tooling for model-server pods and the whole deployment.

- `wait`: the preStop hook `picker drain-wait` (standard library only, also runnable as a copied file).
- `check`: `picker check`, the timing-budget check of Kubernetes manifests and Envoy config; its rules
  live in `k8s_rules`, `envoy_rules` and `crds`, the shared reading in `manifests` and `findings`.

Nothing here is on the request path; none of it imports a frontend. Synchronous code, no event loop.
"""
