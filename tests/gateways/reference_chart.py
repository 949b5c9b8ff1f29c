"""The reference picker's Helm chart, the part that starts the picker's container, rendered in Python.

Helm does not run here, so this follows the chart's deployment template line for line (GIE's
`config/charts/inferencepool` and the llm-d Router's `routerlib` `_deployment.yaml`, 2026): the
container's `args`, its `env` and its probes, from the chart's values. What users change to run
this picker instead is the image alone; everything rendered here then reaches `picker serve`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

DEFAULT_PLUGINS = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
  - pluginRef: prefix-cache-scorer
    weight: 3
"""


@dataclass
class Values:
    """The chart values that shape the container (names as in the chart's values.yaml)."""

    release: str = "vllm-llama"  # the InferencePool is named after the release
    namespace: str = "default"
    replicas: int = 1
    pool_api_version: str = "inference.networking.k8s.io/v1"
    # no InferencePool: the picker selects the model-server pods itself
    endpoint_selector: str | None = None
    endpoint_target_ports: tuple[int, ...] = ()
    plugins_config_file: str = "default-plugins.yaml"
    config_mount: str = "/config"  # where the chart mounts the plugins ConfigMap
    health_port: int = 9003
    tracing: bool = False
    otel_endpoint: str = "http://localhost:4317"
    otel_sampler: str = "parentbased_traceidratio"
    otel_sampler_arg: str = "0.1"
    flags: Mapping[str, Any] = field(default_factory=dict)  # inferenceExtension.flags


def container_args(values: Values) -> list[str]:
    """`args:` of the picker container."""
    args: list[str] = []
    if values.endpoint_selector is None:
        args += ["--pool-name", values.release, "--pool-namespace", values.namespace]
        if values.pool_api_version != "inference.networking.x-k8s.io/v1alpha2":
            args += ["--pool-group", values.pool_api_version.split("/")[0]]
    else:
        args += ["--endpoint-selector", values.endpoint_selector]
        args += ["--endpoint-target-ports", ",".join(map(str, values.endpoint_target_ports))]
    args += ["--zap-encoder", "json"]
    args += ["--config-file", f"{values.config_mount}/{values.plugins_config_file}"]
    args += ["--grpc-health-port", str(values.health_port)]
    args.append("--tracing=true" if values.tracing else "--tracing=false")
    args.append("--metrics-endpoint-auth=false")
    if values.replicas > 1:
        args.append("--ha-enable-leader-election")
    args += [f"--{key}={value}" for key, value in values.flags.items()]
    return args


def container_env(values: Values, pod_name: str) -> dict[str, str]:
    """`env:`, the downward API's fields filled in as the kubelet would."""
    env = {"NAMESPACE": values.namespace, "POD_NAME": pod_name}
    if values.tracing:
        env |= {
            "OTEL_SERVICE_NAME": "gateway-api-inference-extension",
            "OTEL_EXPORTER_OTLP_ENDPOINT": values.otel_endpoint,
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_RESOURCE_ATTRIBUTES_NODE_NAME": "node-1",
            "OTEL_RESOURCE_ATTRIBUTES_POD_NAME": pod_name,
            "OTEL_RESOURCE_ATTRIBUTES": f"k8s.namespace.name={values.namespace},k8s.pod.name={pod_name}",
            "OTEL_TRACES_SAMPLER": values.otel_sampler,
            "OTEL_TRACES_SAMPLER_ARG": values.otel_sampler_arg,
        }
    return env


def probes(values: Values) -> dict[str, str]:
    """The gRPC service each kubelet probe asks for, on the health port."""
    if values.replicas > 1:
        return {"liveness": "liveness", "readiness": "readiness"}
    return {"liveness": "inference-extension", "readiness": "inference-extension"}
