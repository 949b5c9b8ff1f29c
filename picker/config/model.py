"""The picker's configuration: one typed, frozen model (read from a YAML file, then PICKER_* env,
then flags by picker/config/sources.py).

Every default lives here. Invalid values are errors that name the field (e.g. `server.grpc_port`);
nothing falls back silently, and nothing here exits the process (only `cli.py` does).
Longer than 400 lines on purpose: one file is the one place for every setting and its default (the
documentation's configuration page is generated from it, group by group, in this order).
"""

from __future__ import annotations

import functools
import ipaddress
import itertools
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    field_validator,
    model_validator,
)

_MIB = 1024 * 1024


class ConfigError(ValueError):
    """A configuration problem, worded for the operator (names the field or the file)."""


def parse_address(value: str) -> tuple[str, int]:
    """Split "ip:port" / "[v6]:port" / "host:port" and check both halves."""
    text = value.strip()
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
        if not sep:
            raise ValueError(f"{value!r} is not [ipv6]:port")
        ipaddress.IPv6Address(host)
    else:
        host, sep, port = text.rpartition(":")
        if not sep or not host:
            raise ValueError(f"{value!r} is not host:port")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{value!r} has no valid port")
    return host, int(port)


def format_address(host: str, port: int) -> str:
    """The canonical "ip:port" form used as an endpoint's identity (IPv6 in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@functools.lru_cache(maxsize=4096)  # asked of every access-log entry: a lookup costs a fraction of a parse
def canonical_address(value: str) -> str:
    """One spelling per endpoint, whichever source names it (IP addresses in their compressed form)."""
    host, port = parse_address(value)
    try:
        host = ipaddress.ip_address(host).compressed
    except ValueError:
        pass  # a host name
    return format_address(host, port)


class _Group(BaseModel):
    # every figure finite: an infinite lease or interval passed once, then broke what used it
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class ServerConfig(_Group):
    """Where the picker listens. 0.0.0.0 by default because Envoy reaches it over the pod network."""

    bind_address: str = "0.0.0.0"
    grpc_port: int = Field(9002, ge=0, le=65535, description="Envoy ext_proc (gRPC)")
    health_port: int = Field(9003, ge=0, le=65535, description="gRPC health: '', liveness, readiness")
    metrics_port: int = Field(9090, ge=0, le=65535, description="Prometheus /metrics and the admin API")
    # TLS on the ext_proc port, as the reference endpoint picker serves it; health stays plaintext.
    secure_serving: bool = Field(True, description="TLS on grpc_port (false: plaintext)")
    cert_path: Path | None = Field(
        None, description="directory with tls.crt and tls.key, reloaded on change; default: self-signed"
    )
    cert_poll_s: float = Field(1.0, gt=0, description="how often cert_path is checked for a new pair")
    # One Python process tops out near one core (grpc.aio's own machinery is most of a pick's CPU).
    # More than 1: `picker serve` starts this many worker processes sharing grpc_port (SO_REUSEPORT)
    # and one set of books as peers on loopback (picker/lifecycle/workers.py); 1 is one process.
    workers: int = Field(
        1,
        ge=1,
        le=64,
        description="picker processes in this pod, sharing grpc_port and one set of books (docs)",
    )

    # Python's collector every 700 allocations walked a tenth of the picker's own Python per request
    # (picker/lifecycle/heap.py); 0 leaves it as Python sets it.
    gc_gen0_threshold: int = Field(
        10_000,
        ge=0,
        description="allocations between young garbage collections once started (what start built is "
        "frozen); 0: Python's own collector",
    )

    @model_validator(mode="after")
    def _tls_consistent(self) -> ServerConfig:
        if self.cert_path is not None and not self.secure_serving:
            raise ValueError("server.cert_path is set but server.secure_serving is false: choose one")
        return self


class PoolConfig(_Group):
    """Endpoints without Kubernetes: a static list, or a file reloaded when it changes."""

    endpoints: tuple[str, ...] = ()
    endpoints_file: Path | None = Field(
        None, description="YAML list of endpoints (each may say draining: true); reloaded when it changes"
    )
    endpoints_file_poll_s: float = Field(1.0, gt=0, description="how often the file is checked")

    @field_validator("endpoints", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        if isinstance(value, str):
            return tuple(part for part in (p.strip() for p in value.split(",")) if part)
        return value

    @field_validator("endpoints")
    @classmethod
    def _canonical(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(dict.fromkeys(canonical_address(v) for v in value))


_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?(\.[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?)*$"


class KubeSourceConfig(_Group):
    """The Kubernetes sources, in one namespace: the slices of one Service (or a label selector), or
    the pods of one InferencePool (`pool_name`, what the reference picker's --pool-name names).

    RBAC get/list/watch in that namespace: endpointslices (discovery.k8s.io) for the slice source;
    pods, inferencepools (and inferenceobjectives unless `objectives` is off) for the pool source.
    """

    service: str | None = Field(
        None, pattern=_DNS_LABEL, description="watch this Service's slices (label kubernetes.io/service-name)"
    )
    label_selector: str | None = Field(None, min_length=1, description="or: slices matching this selector")
    pool_name: str | None = Field(
        None,
        pattern=_DNS_SUBDOMAIN,
        description="or: the pods of this InferencePool (inference.networking.k8s.io/v1), at its targetPorts",
    )
    objectives: bool = Field(
        True, description="with pool_name: request priorities from InferenceObjectives of the pool"
    )
    namespace: str | None = Field(
        None, pattern=_DNS_LABEL, description="default: the service account's, else the kubeconfig context's"
    )
    target_port: str | None = Field(
        None, description="model-server port on each endpoint, a name or a number; default: the only port"
    )
    kubeconfig: Path | None = Field(
        None, description="default: in-cluster service account, else $KUBECONFIG, else ~/.kube/config"
    )
    watch_timeout_s: int = Field(
        60, ge=1, le=3600, description="the API server ends each watch after this; the picker resumes it"
    )
    inactivity_deadline_s: float = Field(90.0, gt=0, description="a watch silent this long is a dead one")
    request_timeout_s: float = Field(10.0, gt=0, description="connect and list timeout")
    backoff_initial_s: float = Field(0.5, gt=0, description="first pause after a failed list or watch")
    backoff_max_s: float = Field(30.0, gt=0, description="longest pause between retries")
    endpoint_selector: str | None = Field(
        None,
        min_length=1,
        description="or: the pods matching this label selector (no InferencePool), at endpoint_target_ports",
    )
    endpoint_target_ports: tuple[int, ...] = Field(
        (), max_length=8, description="with endpoint_selector: the model-server port(s) of each pod"
    )
    drains_configmap: str | None = Field(
        None,
        pattern=_DNS_SUBDOMAIN,
        description="admin drains shared by every picker replica through this ConfigMap "
        "(RBAC get/list/watch/create/update on configmaps); default: each replica's own",
    )
    # Scale-downs (picker/sources/deletion_cost.py): each pool pod's pod-deletion-cost annotation
    # kept in step with the work on it, so the ReplicaSet controller deletes the cheapest first.
    deletion_cost: bool = Field(
        False,
        description="rank the pool's pods for scale-downs: write controller.kubernetes.io/pod-deletion-cost "
        "(RBAC patch on pods; how costs are made: scale_down)",
    )
    deletion_cost_interval_s: float = Field(
        10.0,
        gt=0,
        le=3600,
        description="with deletion_cost: a pod's annotation changes at most once per this",
    )

    # Pool status (picker/sources/pool_status/): a `Ready` condition on the InferencePool and
    # events on changes of state, drains and rollbacks.
    pool_status: bool = Field(
        False,
        description="report the pool's health on the InferencePool (a Ready condition in status.parents) "
        "and in events (RBAC patch on inferencepools/status, create on events)",
    )
    pool_status_debounce_s: float = Field(
        0.5,
        gt=0,
        le=60,
        description="with pool_status: the view must hold still this long before it is written",
    )
    pool_status_resync_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="with pool_status: the entry is read again this often (rewritten if lost)",
    )
    pool_status_stopping_timeout_s: float = Field(
        2.0,
        gt=0,
        le=60,
        description="with pool_status: at shutdown, the Stopping condition or event is given up after this "
        "(the Lease is handed back next)",
    )

    @model_validator(mode="after")
    def _drains_need_kube(self) -> KubeSourceConfig:
        kube_source = self.enabled or self.pool_name is not None or self.endpoint_selector is not None
        if self.drains_configmap is not None and not kube_source:
            raise ValueError("kube.drains_configmap needs a Kubernetes endpoint source")
        return self

    @model_validator(mode="after")
    def _deletion_cost_needs_kube(self) -> KubeSourceConfig:
        kube_source = self.enabled or self.pool_name is not None or self.endpoint_selector is not None
        if self.deletion_cost and not kube_source:
            raise ValueError("kube.deletion_cost needs a Kubernetes endpoint source (the pods it ranks)")
        return self

    @model_validator(mode="after")
    def _pool_status_needs_pool(self) -> KubeSourceConfig:
        if self.pool_status and self.pool_name is None:
            raise ValueError("kube.pool_status needs kube.pool_name (the InferencePool it reports on)")
        return self

    @model_validator(mode="after")
    def _selector_has_ports(self) -> KubeSourceConfig:
        if self.endpoint_selector is not None and not self.endpoint_target_ports:
            raise ValueError(
                "kube.endpoint_selector needs kube.endpoint_target_ports (--endpoint-target-ports)"
            )
        if self.endpoint_target_ports and self.endpoint_selector is None:
            raise ValueError("kube.endpoint_target_ports is for kube.endpoint_selector")
        if any(not 0 < port < 65536 for port in self.endpoint_target_ports):
            raise ValueError("kube.endpoint_target_ports: ports must be 1-65535")
        return self

    @property
    def enabled(self) -> bool:
        return self.service is not None or self.label_selector is not None

    @property
    def selector(self) -> str:
        if self.service is not None:
            return f"kubernetes.io/service-name={self.service}"
        return self.label_selector or ""

    @field_validator("target_port", mode="before")
    @classmethod
    def _port_text(cls, value: Any) -> Any:
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @field_validator("target_port")
    @classmethod
    def _port_name_or_number(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if value.isdigit():
            if not 0 < int(value) < 65536:
                raise ValueError(f"port {value} is outside 1-65535")
        elif not re.match(_DNS_LABEL, value):
            raise ValueError(f"{value!r} is neither a port number nor a port name")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> KubeSourceConfig:
        if self.service is not None and self.label_selector is not None:
            raise ValueError("kube.service and kube.label_selector: set one, not both")
        if self.pool_name is not None and self.target_port is not None:
            raise ValueError(
                "kube.target_port is for EndpointSlices; with kube.pool_name the pool's targetPorts"
            )
        if self.inactivity_deadline_s <= self.watch_timeout_s:
            raise ValueError(
                f"kube.inactivity_deadline_s ({self.inactivity_deadline_s}) must exceed "
                f"kube.watch_timeout_s ({self.watch_timeout_s}), or every quiet watch would count as dead"
            )
        if self.backoff_initial_s > self.backoff_max_s:
            raise ValueError("kube.backoff_initial_s must not exceed kube.backoff_max_s")
        return self


class AdminConfig(_Group):
    """The admin API on the metrics port: GET /admin/endpoints; POST .../<addr>/drain and .../undrain.

    Changes are accepted from anyone presenting this bearer token; without one configured, from
    loopback peers only.
    """

    token: SecretStr | None = Field(
        None, description="bearer token for changes (16+ chars); without one, loopback callers only"
    )
    # With a token set, loopback callers need it too: behind a sidecar every caller looks local.
    trust_loopback: bool = Field(
        False, description="with a token set, accept loopback callers without it (no sidecar in front)"
    )
    # Who may read /metrics (picker/sources/token_review.py): open by default, as the metrics port
    # always was; a static bearer token, and/or any token the API server vouches for (TokenReview).
    metrics_token: SecretStr | None = Field(
        None, min_length=16, description="/metrics needs this bearer token (e.g. from a Secret)"
    )
    metrics_auth: bool = Field(
        False,
        description="/metrics needs a bearer token the API server vouches for (TokenReview) and "
        "allows to get /metrics (SubjectAccessReview)",
    )
    # The admin API's reads (GET /admin/status, /admin/endpoints[/<addr>], /admin/drains,
    # /admin/rollout) show the pool, its drains and the canary. `metrics` (the default): they ask
    # what /metrics asks (the metrics token, or a token reviewed as above), or the admin token, or
    # come from where a change may (loopback, without an admin token or with trust_loopback); so
    # they stay open while /metrics is. `open`: anyone who reaches the port reads them.
    read_auth: Literal["metrics", "open"] = Field(
        "metrics", description="who may read the admin API: as /metrics (or an admin caller), or anyone"
    )
    # The capacity guard (picker/scheduling/capacity.py): a drain whose endpoint's slots the
    # remaining ready endpoints cannot replace under the live demand waits or is refused (409).
    drain_guard: bool = Field(
        True, description="refuse an admin drain that would leave less ready capacity than the demand"
    )
    drain_headroom: float = Field(
        0.1, ge=0, le=10, description="the capacity guard wants demand x (1 + this) to stay ready"
    )
    drain_wait_max_s: float = Field(
        300.0, ge=0, le=3600, description="longest `?wait=` a guarded drain may wait for a replacement"
    )

    @field_validator("token")
    @classmethod
    def _long_enough(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < 16:
            raise ValueError("must be at least 16 characters")
        return value


class EdsConfig(_Group):
    """Envoy's pool cluster over xDS EDS, served on the ext_proc port from the pool view."""

    enabled: bool = Field(True, description="serve EndpointDiscoveryService on grpc_port")
    debounce_s: float = Field(0.05, gt=0, le=5, description="a burst of pool changes becomes one push")
    resync_s: float = Field(0.5, gt=0, le=30, description="look for changes not announced (forgotten GONE)")
    ack_timeout_s: float = Field(
        2.0, ge=0, le=60, description="an admin drain's answer waits this long for Envoy to ACK it"
    )


class SchedulingConfig(_Group):
    fallback_count: int = Field(2, ge=0, le=8, description="endpoints listed after the primary")
    # The EPP protocol wants the same value in the destination header and envoy.lb metadata, and an
    # ORIGINAL_DST cluster answers a list with 503 (measured): list fallbacks only to data planes
    # known to read them with override_host. "auto": when the routing stream declares it (gRPC
    # metadata x-picker-data-plane: override-host, as config/envoy.yaml does) or once the data plane
    # has reported a served endpoint on that gRPC connection (override_host's selected_host_key);
    # "always"; "never".
    fallbacks: Literal["auto", "always", "never"] = "auto"
    # A replica whose answers fail before their first byte (5xx, reset, refused connection) is
    # suspect after this many in a row: never the primary, last resort only (picker/pool/health.py).
    suspect_after_failures: int = Field(3, ge=0, description="failures in a row before suspect (0: never)")
    suspect_backoff_s: float = Field(1.0, gt=0, description="first suspicion lasts this long, then doubles")
    suspect_max_backoff_s: float = Field(30.0, gt=0, description="longest suspicion (also vLLM's drain 500)")
    failed_before_drain_window_s: float = Field(
        10.0, gt=0, description="a drain record counts the endpoint's failures this long before it opened"
    )

    by_model: bool = Field(
        False,
        description="only to endpoints whose /v1/models lists the request's model (or adapter) with a "
        "context window its prompt + max_tokens fits; none: the contract's 404 / 400 (--route-by-model)",
    )
    models_interval_s: float = Field(30.0, gt=0, description="with by_model: how often /v1/models is re-read")
    # The reference picker's plugin configuration (an EndpointPickerConfig: `--config-file` /
    # `--config-text`, as its Helm chart passes it); read at start by picker/config/plugins.py.
    config_file: Path | None = Field(None, description="EndpointPickerConfig file (--config-file)")
    config_text: str | None = Field(None, description="EndpointPickerConfig as text (--config-text)")

    @model_validator(mode="after")
    def _one_plugin_config(self) -> SchedulingConfig:
        if self.config_file is not None and self.config_text is not None:
            raise ValueError("scheduling.config_file and scheduling.config_text: set one, not both")
        return self

    @model_validator(mode="after")
    def _backoff_ordered(self) -> SchedulingConfig:
        if self.suspect_backoff_s > self.suspect_max_backoff_s:
            raise ValueError("scheduling.suspect_backoff_s must not exceed scheduling.suspect_max_backoff_s")
        return self


_METRIC_NAME = r"^[a-zA-Z_:][a-zA-Z0-9_:]*$"


class LoadConfig(_Group):
    """Load signals scraped from each endpoint's own /metrics, and how they score."""

    scrape: bool = Field(True, description="false: no scraping, schedule by in-flight count alone")
    engine: Literal["vllm", "sglang"] = Field(
        "vllm", description="whose gauge names to read: vLLM's or SGLang's (each name overridable below)"
    )
    running_gauge: str | None = Field(
        None, pattern=_METRIC_NAME, description="gauge of requests running on the engine (default: engine's)"
    )
    waiting_gauge: str | None = Field(
        None, pattern=_METRIC_NAME, description="gauge of requests queued on the engine (default: engine's)"
    )
    kv_gauge: str | None = Field(
        None, pattern=_METRIC_NAME, description="gauge of KV-cache usage, 0-1 (default: engine's)"
    )
    lora_info_metric: str | None = Field(
        None, pattern=_METRIC_NAME, description="LoRA adapters info series (default: vllm:lora_requests_info)"
    )
    metrics_port: int | None = Field(
        None, ge=1, le=65535, description="scrape this port of each endpoint's host (default: its own)"
    )
    metrics_path: str = Field("/metrics", pattern=r"^/[^\s?#]*$")
    metrics_scheme: Literal["http", "https"] = Field(
        "http", description="https scrapes without verifying the certificate, as the reference picker does"
    )
    scrape_interval_s: float = Field(0.1, gt=0)
    # Where a data-plane connection hides responses' ends, the books lag the engines by one scrape
    # interval (docs, "Behind your gateway"): scrape more often then.
    blind_scrape_interval_s: float = Field(
        0.05, gt=0, description="the scrape interval while a data plane hides responses' ends"
    )
    scrape_timeout_s: float = Field(0.5, gt=0)
    max_backoff_s: float = Field(5.0, gt=0, description="longest pause after repeated scrape failures")
    max_page_bytes: int = Field(4 * _MIB, ge=1024, description="larger /metrics pages count as a failure")
    max_gauge_lines: int = Field(
        256, ge=6, le=4096, description="pages with more running/waiting/KV-cache lines count as a failure"
    )
    staleness_s: float = Field(2.0, gt=0, description="older metrics count as saturated")
    waiting_threshold: float = Field(1.0, gt=0, description="saturated at this many queued on the engine")
    kv_threshold: float = Field(0.9, gt=0, le=1, description="saturated at this KV-cache usage")
    engine_slots: int | None = Field(None, ge=1, description="vLLM --max-num-seqs, if known")
    weight_load: float = Field(1.0, ge=0)
    weight_waiting: float = Field(2.0, ge=0)
    weight_kv: float = Field(10.0, ge=0)


class FlowConfig(_Group):
    """The admission queue in front of saturated engines."""

    max_queued: int = Field(1000, ge=0)
    max_queued_bytes: int = Field(256 * _MIB, ge=0)
    ttl_s: float = Field(30.0, gt=0, description="longest wait in the queue before a 429/503")
    envoy_max_message_timeout_s: float = Field(
        60.0,
        gt=0,
        description="Envoy ext_proc max_message_timeout: how long Envoy lets a queued request wait",
    )
    reject_without_endpoints: bool = Field(False, description="503 at once instead of waiting for endpoints")

    @model_validator(mode="after")
    def _ttl_fits_envoy(self) -> FlowConfig:
        if self.ttl_s >= self.envoy_max_message_timeout_s:
            raise ValueError(
                f"ttl_s ({self.ttl_s}) must be below envoy_max_message_timeout_s "
                f"({self.envoy_max_message_timeout_s}), or Envoy gives up on queued requests first"
            )
        return self


class RequestsConfig(_Group):
    max_body_bytes: int = Field(8 * _MIB, ge=1024, description="larger bodies get 413 too-large")
    max_model_name_bytes: int = Field(
        256, ge=16, le=8192, description="longer 'model' fields get 400 (the name is a metric label)"
    )
    max_hint_header_bytes: int = Field(
        256,
        ge=16,
        le=8192,
        description="longer x-gateway-inference-fairness-id / -priority headers get 400 bad-request",
    )
    enable_test_hooks: bool = Field(
        False,
        description="GIE conformance hooks: test-epp-endpoint-selection restricts the pick, and the "
        "served endpoint is echoed in x-conformance-test-served-endpoint (never in production)",
    )


class StreamsConfig(_Group):
    # Envoy sends the observer stream's request headers before the upstream request starts, so a
    # dispatched request whose observer has not shown up by the time routing ends within this grace
    # was never going to be observed (observer filter missing): release its slot instead of leaking it.
    observer_attach_grace_s: float = Field(2.0, gt=0)
    # Where nothing reports a response's end (docs, "Gateways": response headers only, NGINX Gateway
    # Fabric's shim), a request counts on its replica by the picker's own books only until the
    # engine's scraped gauges can show it: a scrape sent less than this after the request was sent
    # may not count it yet (the data plane's hop to the engine), later ones do.
    engine_transit_s: float = Field(
        0.05, ge=0, le=10, description="blind shapes: how long a sent request may take to reach its engine"
    )
    # When a stream ends short of its response, Envoy's access log (sent a moment later) says who
    # cut it; this is how long to wait for it before calling the ending unobserved. Above Envoy's
    # default buffer_flush_interval (1 s), which a gateway's generated gRPC access log may keep.
    access_log_grace_s: float = Field(2.0, gt=0)
    stall_after_s: float = Field(30.0, gt=0, description="silence after which a stream counts as stalled")
    # A client that leaves a stream its engine had stopped sending for this long left because of the
    # silence (vLLM abandons streams at its --shutdown-timeout): a drain record counts it as `cut`.
    cut_after_silence_s: float = Field(
        5.0, gt=0, description="client left a stream silent this long: counted as cut, not client-disconnect"
    )
    # Who reports a response's end when the routing filter sees no response body: an observer
    # filter ("observer"), Envoy's access log ("access-log": the lean shape), nobody ("engine": the
    # engines' scraped running counts end requests and close drain records), or "auto": the observer
    # once one has attached, else the access log once an entry has come, else the engines. Where an
    # observer reports ("observer", or "auto" on a gRPC connection an observer stream came on), the
    # routing stream ends at its answer: response headers never wait for the picker.
    response_end: Literal["auto", "observer", "access-log", "engine"] = "auto"
    # picker proxy (docs, "Streams that survive their replica"): a stream cut after its first token
    # is continued on another replica from its token ids. off: only requests that ask
    # (x-picker-resume: on); greedy: every greedy request; always: sampled ones too
    resume: Literal["off", "greedy", "always"] = Field(
        "off", description="continue a cut stream on another replica (picker proxy)"
    )
    resume_max: int = Field(2, ge=1, le=10, description="resumes of one stream, at most")
    resume_max_tokens: int = Field(
        32768,
        ge=0,
        description="prompt and output token ids a resumable stream keeps, at most (0: no cap); past it "
        "the stream is no longer resumed (reason too-long). About 70 bytes a token: 2.3 MB at the cap",
    )
    # a drain need not wait for its longest answer: this long after a replica's drain began, its
    # resumable streams continue on other replicas (picker proxy; none: they run to their end)
    move_after_s: float | None = Field(
        None, gt=0, description="move a draining replica's resumable streams after this long (picker proxy)"
    )


class ShutdownConfig(_Group):
    """The picker's own shutdown: one budget, spent in phases (see picker/lifecycle/shutdown.py)."""

    drain_timeout_s: float = Field(30.0, ge=0, description="the whole budget, from SIGTERM to exit")
    propagation_s: float = Field(5.0, ge=0, description="longest wait for load balancers to notice")
    quiet_interval_s: float = Field(1.0, gt=0, description="two of these without arrivals end phase 1")

    @model_validator(mode="after")
    def _fits(self) -> ShutdownConfig:
        if self.propagation_s > self.drain_timeout_s:
            raise ValueError(
                f"propagation_s ({self.propagation_s}) must not exceed drain_timeout_s "
                f"({self.drain_timeout_s})"
            )
        return self


class AffinityConfig(_Group):
    """Cache-aware routing (docs, "Cache-aware routing"): prefix, LoRA and session affinity."""

    prefix: Literal["off", "approximate", "precise"] = Field(
        "approximate",
        description="approximate: learned from what was routed where; precise: the engines' KV events "
        "and token ids from their /tokenize; off: load alone",
    )
    block_tokens: int = Field(64, ge=16, le=4096, description="approximate: pseudo-tokens per block")
    bytes_per_token: int = Field(4, ge=1, le=16, description="approximate: prompt bytes per pseudo-token")
    max_blocks: int = Field(2048, ge=1, description="blocks of a prompt hashed at most")
    index_blocks: int = Field(
        31250, ge=64, description="approximate: blocks kept per endpoint (its num_gpu_blocks when published)"
    )
    sticky_threshold: float = Field(
        0.5, ge=0, le=1.01, description="share of the prompt an endpoint must hold to keep it (above 1: off)"
    )
    max_load_gap: float = Field(
        4.0, ge=0, description="sticky while within this many requests of the least load"
    )
    load_gap_ratio: float = Field(0.25, ge=0, description="... or this share of the least load, when more")
    balance_ratio: float = Field(
        0.2, ge=0, description="sticky while its load averaged over seconds is within this of the pool's mean"
    )
    balance_window_s: float = Field(2.0, gt=0, description="the time constant of that average")
    prefill_penalty_tokens: float = Field(
        65536, ge=0, description="sticky while its prefill wait is within this many tokens of the quickest's"
    )
    prefix_weight: float = Field(3.0, ge=0, description="score weight of the cached share of the prompt")
    load_weight: float = Field(2.0, ge=0, description="score weight of the load (queue and KV cache)")
    lora_weight: float = Field(2.0, ge=0, description="score weight of LoRA affinity")
    room_weight: float = Field(1.0, ge=0, description="score weight of room in the cache (cold prompts)")
    session_header: str | None = Field(
        None, pattern=r"^[a-z0-9-]+$", description="request header naming a session (e.g. x-session-id)"
    )
    session_ttl_s: float = Field(
        300.0, gt=0, description="a session stays bound this long after its last request"
    )
    engine_feedback: bool = Field(
        True, description="approximate: correct the index by the cached tokens engines report in usage"
    )
    kv_events_port: int = Field(5557, ge=1, le=65535, description="precise: each engine's KV-event port")
    kv_events_port_offset: int | None = Field(
        None, ge=-65535, le=65535, description="precise: or the endpoint's own port plus this (one host)"
    )
    kv_events_topic: str = Field("kv@", description="precise: the topic prefix subscribed to")
    tokenize_timeout_s: float = Field(0.5, gt=0, description="precise: an engine's /tokenize answer, at most")
    # Routing by predicted latency (picker/scheduling/latency.py; docs, "Cache-aware routing"): each
    # replica's TTFT and time per output token learned online; the SLO headers are read with it on.
    latency: Literal["auto", "on", "off"] = Field(
        "auto",
        description="route by each replica's predicted TTFT, learned online (and read SLO headers); "
        "auto: learned always, routed by while the pool is not uniform (latency_engage_ratio, with "
        "hysteresis); true/false mean on/off",
    )
    latency_weight: float = Field(4.0, ge=0, description="score weight of the predicted TTFT")
    scale_down_weight: float = Field(
        2.0,
        ge=0,
        description="with kube.deletion_cost: score weight of keeping long requests off the pods a "
        "scale-down takes next, within the load gap (scale_down.steer_s says how long is long)",
    )
    latency_gap_ratio: float = Field(
        0.3,
        ge=0,
        description="a replica is a choice while its predicted TTFT is within this share of the best",
    )
    latency_gap_s: float = Field(0.1, ge=0, description="... or within this many seconds of it")
    latency_half_life_s: float = Field(
        5.0, gt=0, le=3600, description="an observation's weight in the model halves every this many seconds"
    )
    latency_engine_queue: int = Field(
        0,
        ge=0,
        description="with latency on, and auto while engaged: requests that may wait on an engine for a "
        "batch slot (0: they wait in the picker, bound late to the first slot that frees, the earliest "
        "due first)",
    )
    latency_engage_ratio: float = Field(
        1.4,
        gt=1,
        description="auto: engaged when the slower replicas' predicted time for the pool's typical request "
        "is at least this many times the quicker ones' (split where the gap is widest), for "
        "latency_engage_after_s",
    )
    latency_engage_after_s: float = Field(
        1.0, ge=0, description="auto: how long the pool must look not uniform before it engages"
    )
    latency_release_ratio: float = Field(
        1.2, gt=1, description="auto: released when it is below this many times, for latency_release_after_s"
    )
    latency_release_after_s: float = Field(
        10.0, ge=0, description="auto: how long the pool must look uniform before it is released"
    )

    @field_validator("latency", mode="before")
    @classmethod
    def _latency_switch(cls, value: object) -> object:
        """true / false (this setting's old form, and the environment's) mean on / off."""
        if isinstance(value, bool):
            return "on" if value else "off"
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return "on" if value.lower() == "true" else "off"
        return value

    @model_validator(mode="after")
    def _latency_hysteresis(self) -> AffinityConfig:
        if self.latency_release_ratio > self.latency_engage_ratio:
            raise ValueError("affinity.latency_release_ratio must not exceed affinity.latency_engage_ratio")
        return self


class PdConfig(_Group):
    """Prefill / decode pools (docs, "Prefill / decode pools"): roles from labels, a pick of two, pairs
    of one revision. A pool is routed as pairs only while some endpoint's role is prefill alone."""

    role_label: str = Field(
        "llm-d.ai/role",
        min_length=1,
        description="the endpoint label naming its role: prefill, decode or both",
    )
    revision_label: str = Field(
        "app.kubernetes.io/version",
        min_length=1,
        description="the endpoint label naming its revision: a pair never spans two values",
    )
    prefill_min_tokens: int = Field(
        256,
        ge=0,
        description="a prefill hop only when the decode replica would compute this many prompt tokens itself",
    )


class DrainConfig(_Group):
    """How drains treat work that outlives a request's own stream."""

    kv_pull_timeout_s: float = Field(
        30.0,
        gt=0,
        description="a draining prefill replica waits this long for decode replicas to pull its KV",
    )


class PeersConfig(_Group):
    """Several pickers with one set of books (docs, "Two pickers"): each request's end reaches the
    picker that routed it, and each counts the others' requests on every endpoint."""

    members: tuple[str, ...] = Field(
        (), description="every picker's peer address host:port (this one's may be listed); empty: alone"
    )
    service: str | None = Field(
        None,
        description="or, found by DNS: host:port of a headless Service over the picker pods, re-resolved",
    )
    resolve_interval_s: float = Field(5.0, gt=0, description="with service: how often it is re-resolved")
    port: int = Field(9004, ge=0, le=65535, description="where this picker serves its peers (plaintext)")
    bind_address: str | None = Field(
        None, description="where the peer port listens; default server.bind_address (workers: loopback)"
    )
    advertise: str | None = Field(
        None, description="this picker's own address in members; default $POD_IP (else bind_address):port"
    )
    ready_timeout_s: float = Field(
        5.0,
        ge=0,
        description="readiness waits at most this long for every peer's link both ways (0: no wait)",
    )
    read_every_s: float = Field(
        0.01,
        gt=0,
        description="what peers sent is read before each admission, and at least this often",
    )
    move_timeout_s: float = Field(
        2.0,
        gt=0,
        le=30,
        description="drain ?move_streams=true: how long each peer gets to answer the ask to move its streams",
    )
    # Connections on the peer port that have not said their hello are strangers': each may hold a
    # few KiB for a few seconds (picker/peers/listener.py), and only so many at once. A member needs
    # one for its link and one per question it asks (drains, moves) while it is being answered; from
    # an address a member is named by, it waits apart from the strangers (their total cannot block it).
    max_unauthenticated: int = Field(
        64,
        ge=1,
        le=100_000,
        description="connections on the peer port not past their hello, in all: more are refused (counted)",
    )
    max_unauthenticated_per_source: int = Field(
        8,
        ge=1,
        le=100_000,
        description="... and from one source (an IPv4 address, an IPv6 /64; each peer's address has its "
        "own): more are refused (counted)",
    )
    # The pickers' own credential (picker/peers/auth.py: a mutual handshake and HMACs, never sent), from
    # a Secret (PICKER_PEERS__SECRET, or --peer-secret-file); not the admin token.
    secret: SecretStr | None = Field(
        None, min_length=16, description="the pickers' shared peer credential (16+ chars, from a Secret)"
    )
    allow_unauthenticated: bool = Field(
        False, description="peers without a credential: only for loopback test setups (said in the log)"
    )

    def credential(self) -> str | None:
        """The pickers' credential (None: peers.allow_unauthenticated, said in the log)."""
        return None if self.secret is None else self.secret.get_secret_value()

    @model_validator(mode="after")
    def _credential(self) -> PeersConfig:
        if (self.members or self.service) and self.secret is None and not self.allow_unauthenticated:
            raise ValueError(
                "peers need a credential: set peers.secret from a Secret (PICKER_PEERS__SECRET or "
                "--peer-secret-file); peers.allow_unauthenticated is for loopback-only test setups"
            )
        return self

    @field_validator("members", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        if isinstance(value, str):
            return tuple(part for part in (p.strip() for p in value.split(",")) if part)
        return value

    @field_validator("members")
    @classmethod
    def _canonical(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(dict.fromkeys(canonical_address(v) for v in value))

    @field_validator("service")
    @classmethod
    def _host_port(cls, value: str | None) -> str | None:
        if value is not None:
            parse_address(value)
        return value


class LeaderConfig(_Group):
    """Active-passive, as the reference picker's `--ha-enable-leader-election`: the replicas campaign
    for a coordination.k8s.io/v1 Lease and only its holder is ready (the others stand by, warm).
    RBAC in kube.namespace: get/create/update on leases. Timings are client-go's defaults."""

    enabled: bool = Field(False, description="campaign for the Lease; ready only while holding it")
    lease_name: str | None = Field(
        None, pattern=_DNS_SUBDOMAIN, description="default: <kube.pool_name or kube.service>-picker-leader"
    )
    identity: str | None = Field(None, min_length=1, description="default: $POD_NAME, else host_<random>")
    lease_duration_s: float = Field(15.0, gt=0, description="a standby takes a lease not renewed this long")
    renew_deadline_s: float = Field(
        10.0, gt=0, description="the leader stands down if it cannot renew by then"
    )
    retry_period_s: float = Field(2.0, gt=0, description="how often each replica tries to acquire or renew")

    @model_validator(mode="after")
    def _timings(self) -> LeaderConfig:
        if not self.retry_period_s < self.renew_deadline_s < self.lease_duration_s:
            raise ValueError(
                "leader: retry_period_s < renew_deadline_s < lease_duration_s is required (a leader must "
                "stand down before a standby may take its lease)"
            )
        return self


class ScaleDownConfig(_Group):
    """How kube.deletion_cost ranks the pool's pods (picker/pool/deletion_cost.py, deletion_rank.py):
    a pod costs its longest stream's time left (its drain) + work_weight x the sum of its streams'
    times left + cache_s x its share of the largest cache; an order that changes only for a clear
    difference (margin_s and margin_ratio), written as int32 values."""

    unknown_tokens: int = Field(
        512, ge=1, description="tokens a stream without max_tokens is expected to send in all"
    )
    time_per_token_s: float = Field(
        0.03, gt=0, description="time per token where no stream of the replica or the pool measured it yet"
    )
    work_weight: float = Field(0.1, ge=0, description="weight of the summed time left beside the longest")
    cache_s: float = Field(0.0, ge=0, description="seconds of cost the largest cache in the pool is worth")
    margin_s: float = Field(
        5.0, ge=0, description="a pod moves ahead of another only when cheaper by more than this ..."
    )
    margin_ratio: float = Field(0.1, ge=0, description="... and than this share of the other's cost")
    step_s: float = Field(1.0, gt=0, le=60, description="how often the costs are computed")
    max_writes: int = Field(20, ge=1, le=1000, description="annotation writes per step, at most")
    steer_s: float = Field(
        30.0,
        ge=0,
        description="a request expected to run this long or longer is kept off the pods a scale-down "
        "takes next (affinity.scale_down_weight), a shorter one in proportion; 0: none is",
    )


class AutoscalingConfig(_Group):
    """The pool's autoscaling signals on /metrics (picker_pool_*, computed at scrape time): what an
    HPA or KEDA scales the model-server Deployment on (docs, "Autoscaling signals")."""

    pool_label: str | None = Field(
        None,
        min_length=1,
        max_length=253,
        description="the `pool` label of the picker_pool_* and queue gauges; default: kube.pool_name, "
        "else kube.service, else `default`",
    )
    rate_window_s: float = Field(
        60.0, gt=0, le=3600, description="predicted wait: the pool's completions per second over this window"
    )


class TracingConfig(_Group):
    """OpenTelemetry traces: one per request (admission, queue wait, pick, the stream to its end),
    exported over OTLP. The standard OTEL_* environment sets the endpoint, sampler and service name."""

    enabled: bool = Field(False, description="export a trace per request (--tracing)")
    exporter: Literal["otlp", "console"] = Field(
        "otlp",
        description="otlp: OTEL_EXPORTER_OTLP_ENDPOINT (gRPC, default localhost:4317); console: stdout",
    )


class ProxyConfig(_Group):
    """`picker proxy`: the standalone reverse proxy (HTTP in, model servers out), no Envoy."""

    port: int = Field(8080, ge=0, le=65535, description="where clients send OpenAI requests")
    connect_timeout_s: float = Field(1.0, gt=0, description="per upstream attempt; then the next pick")
    headers_timeout_s: float | None = Field(
        None, gt=0, description="longest wait for an upstream's response headers (none: as long as it takes)"
    )
    max_attempts: int = Field(
        3, ge=1, le=9, description="upstream attempts before the first byte, along the picker's ordered list"
    )
    max_connections: int = Field(1024, ge=1, description="pooled keep-alive connections to model servers")
    pd_steps: Literal["proxy", "sidecar"] = Field(
        "proxy",
        description="a prefill / decode pair: the proxy sends the prefill step, then the decode with its "
        "kv_transfer_params (proxy), or names the prefill replica in x-prefiller-host-port to the decode "
        "replica, whose llm-d routing sidecar does both (sidecar)",
    )
    pd_prefill_timeout_s: float = Field(
        120.0, gt=0, description="longest prefill step (proxy pd_steps); then the decode computes the prompt"
    )


def steps_of(text: str | list[int] | tuple[int, ...]) -> tuple[int, ...]:
    """`5,25,50,100` (or a list) as steps: increasing weights 1-100, ending at 100."""
    values = [int(v) for v in (text.split(",") if isinstance(text, str) else text)]
    if not values or values[-1] != 100 or any(not 0 < v <= 100 for v in values):
        raise ValueError("rollout steps: weights 1-100 ending at 100, e.g. 5,25,50,100")
    if any(b <= a for a, b in itertools.pairwise(values)):
        raise ValueError("rollout steps must increase")
    return tuple(values)


class RolloutConfig(_Group):
    """A canary (picker/rollout): endpoints whose `group_label` is `candidate` get `weight` % of new
    requests, stepping through `steps` while the gates pass against the `stable` group; a failed
    gate sets the weight to 0 and drains the candidate. Off until `candidate` is set."""

    group_label: str = Field("app.kubernetes.io/version", description="the endpoint label naming its group")
    stable: str | None = Field(None, description="the stable group's label value (informative)")
    candidate: str | None = Field(None, description="the candidate group's label value; set: a canary runs")
    steps: tuple[int, ...] = Field((5, 25, 50, 100), description="candidate weights (%), ending at 100")
    step_interval_s: float = Field(60.0, gt=0, description="a step lasts at least this long")
    step_min_requests: int = Field(0, ge=0, description="... and routes at least this many requests")
    window_s: float = Field(30.0, gt=0, description="the gates judge the last this-many seconds")
    tick_s: float = Field(1.0, gt=0, le=60, description="how often the gates are judged")
    min_samples: int = Field(
        20, ge=1, description="a gate waits until each group ended this many in the window"
    )
    cut_ratio: float = Field(2.0, gt=0, description="candidate truncation + cut rate over stable's: at most")
    cut_floor: float = Field(0.02, ge=0, le=1, description="a cut rate at or below this always passes")
    error_ratio: float = Field(2.0, gt=0, description="candidate 5xx-before-first-byte rate over stable's")
    error_floor: float = Field(0.02, ge=0, le=1, description="a 5xx rate at or below this always passes")
    ttft_ratio: float = Field(1.5, gt=0, description="candidate TTFT p95 over stable's: at most")
    itl_ratio: float = Field(1.5, gt=0, description="candidate ITL p95 over stable's: at most")
    latency_floor_s: float = Field(0.02, ge=0, description="a p95 this little above stable's always passes")
    drain_on_rollback: bool = Field(True, description="a rollback drains the candidate's endpoints")
    move_streams: bool = Field(
        False,
        description="picker proxy, streams.resume: a rollback also moves the candidate's streams",
    )

    @field_validator("steps", mode="before")
    @classmethod
    def _steps(cls, value: Any) -> Any:
        return steps_of(value) if isinstance(value, str | list | tuple) else value


class TokenBudgetConfig(_Group):
    """One tenant's token budget (docs, "Flow control", Tenants): a bucket refilled at
    `tokens_per_minute`, holding at most `burst`, shared by every picker that shares the books."""

    tokens_per_minute: float = Field(gt=0, le=1e12, description="tokens the budget refills a minute")
    burst: float | None = Field(
        None, gt=0, le=1e12, description="the most the budget holds (default: a minute's tokens)"
    )


class TenantsConfig(_Group):
    """Tenants (the fairness id header): fair share of a saturated pool by tokens (docs, "Flow
    control", Tenants). Requests without the header are not counted and cost nothing."""

    fair_share: Literal["on", "off"] = Field(
        "on",
        description="on: queued tenants are served by tokens per weight, and a tenant over its share of "
        "the batch slots leaves a reserve to the others; off: tenants take turns by request",
    )
    weights: dict[str, float] = Field(
        default_factory=dict, description="weight by tenant id (default_weight for the rest)"
    )
    default_weight: float = Field(1.0, gt=0, description="the weight of a tenant not in weights")
    max_tracked: int = Field(
        1000, ge=1, le=100_000, description="tenants tracked at once; further ids share the 'other' bucket"
    )
    active_s: float = Field(
        10.0, gt=0, description="a tenant counts as active this long after its last request (the reserve)"
    )
    default_max_tokens: int = Field(
        256, ge=1, description="the output tokens reserved for a request that sets no max_tokens"
    )
    budgets: dict[str, TokenBudgetConfig] = Field(
        default_factory=dict,
        description="token budget by tenant id: a request is reserved its prompt and max_tokens at "
        "admission, settled to the engine's usage at its end; over budget: 429 rejected-over-budget",
    )

    @field_validator("weights")
    @classmethod
    def _positive_weights(cls, value: dict[str, float]) -> dict[str, float]:
        for tenant, weight in value.items():
            if not weight > 0 or weight != weight or weight == float("inf"):
                raise ValueError(f"tenants.weights[{tenant!r}] must be a finite number above 0")
        return value


class PickerConfig(BaseModel):
    """All of the picker's settings, grouped by plane. `load_config` builds it from file, env, flags."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    server: ServerConfig = ServerConfig()
    pool: PoolConfig = PoolConfig()
    kube: KubeSourceConfig = KubeSourceConfig()
    admin: AdminConfig = AdminConfig()
    eds: EdsConfig = EdsConfig()
    scheduling: SchedulingConfig = SchedulingConfig()
    load: LoadConfig = LoadConfig()
    flow: FlowConfig = FlowConfig()
    requests: RequestsConfig = RequestsConfig()
    streams: StreamsConfig = StreamsConfig()
    shutdown: ShutdownConfig = ShutdownConfig()
    proxy: ProxyConfig = ProxyConfig()
    affinity: AffinityConfig = AffinityConfig()
    pd: PdConfig = PdConfig()
    drain: DrainConfig = DrainConfig()
    peers: PeersConfig = PeersConfig()
    leader: LeaderConfig = LeaderConfig()
    tracing: TracingConfig = TracingConfig()
    rollout: RolloutConfig = RolloutConfig()
    scale_down: ScaleDownConfig = ScaleDownConfig()
    autoscaling: AutoscalingConfig = AutoscalingConfig()
    tenants: TenantsConfig = TenantsConfig()
    log_level: str = Field("INFO", pattern="^(DEBUG|INFO|WARNING|ERROR)$")
    log_format: Literal["text", "json"] = Field("text", description="json: one JSON object per line")

    def pool_label(self) -> str:
        """The `pool` label of the per-pool gauges: one picker serves one pool, named once here."""
        return self.autoscaling.pool_label or self.kube.pool_name or self.kube.service or "default"

    @model_validator(mode="after")
    def _one_endpoint_source(self) -> PickerConfig:
        chosen = [
            name
            for name, on in (
                ("pool.endpoints", bool(self.pool.endpoints)),
                ("pool.endpoints_file", self.pool.endpoints_file is not None),
                ("kube.service", self.kube.service is not None),
                ("kube.label_selector", self.kube.label_selector is not None),
                ("kube.pool_name", self.kube.pool_name is not None),
                ("kube.endpoint_selector", self.kube.endpoint_selector is not None),
            )
            if on
        ]
        if len(chosen) > 1:
            raise ValueError(f"choose one endpoint source: {', '.join(chosen)} are all set")
        return self

    @model_validator(mode="after")
    def _workers_alone(self) -> PickerConfig:
        # every worker would campaign under the pod's one identity
        if self.server.workers > 1 and self.leader.enabled:
            raise ValueError("server.workers > 1 and leader.enabled: a pod's workers are active-active")
        return self
