"""The scale-down benchmark: a Deployment of simulated vLLM replicas under streaming load scaled down,
its victims chosen by the ReplicaSet controller's own rule and then by the picker's pod-deletion-cost
(`python -m loadtest.scale_down`, `make scale-down`).

Modules: `replicaset` (the controller's deletion order, pure), `cluster` (the fake API server as a
namespace: pods, one EndpointSlice each, the controllers and the kubelet's drain), `run` (one run:
the simulator, `picker proxy`, the load, the scale-downs), `report` (the figures side by side).
"""
