"""The catalogue of `picker check` rules (id, severity, why) and the report they write to.

One place says what every rule id means; the rule code (k8s_rules, envoy_rules, crds) only decides
where a rule fires and with what numbers. Longer than 400 lines on purpose: the catalogue is one
table, most of it the rules' reasons.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from picker.drain.manifests import Document, FieldPath, format_path


class Severity(enum.StrEnum):
    ERROR = "error"
    WARNING = "warning"
    INFO = "info"


@dataclass(frozen=True)
class Rule:
    id: str
    severity: Severity
    title: str
    why: str


E, W, I = Severity.ERROR, Severity.WARNING, Severity.INFO  # noqa: E741

_CATALOGUE = (
    Rule("INPUT-001", E, "input unreadable", "A file that cannot be read or parsed was not checked at all."),
    # the termination budget of a model-server pod
    Rule(
        "GRACE-001",
        E,
        "grace period below the drain budget",
        "The grace period covers the preStop hook and the engine's drain after SIGTERM; when they do not "
        "fit, the kubelet SIGKILLs the engine and every stream still running is cut.",
    ),
    Rule(
        "GRACE-002",
        E,
        "picker grace below the model servers'",
        "When a node drains, the picker and the model servers stop together; a picker that is killed "
        "first stops routing around draining engines and forgets the streams it tracks.",
    ),
    Rule(
        "GRACE-003",
        E,
        "picker --drain-timeout below the model servers' drain",
        "The picker keeps serving for --drain-timeout after its SIGTERM; a shorter budget than the "
        "model servers' drain ends the picker while their streams still run.",
    ),
    Rule(
        "GRACE-004",
        E,
        "picker grace below its own drain",
        "The picker needs its whole --drain-timeout plus time to exit before the kubelet's SIGKILL.",
    ),
    Rule(
        "VLLM-001",
        E,
        "vLLM without --shutdown-timeout",
        "Without it vLLM aborts on SIGTERM: in-flight streams end cut, with an error event, or hang.",
    ),
    Rule(
        "VLLM-002",
        W,
        "--shutdown-timeout below the longest stream",
        "Streams that outlive --shutdown-timeout hang: vLLM kills the engine and leaves the connection "
        "open with no error and no [DONE].",
    ),
    Rule(
        "PRESTOP-001",
        E,
        "model server without a preStop hook",
        "Endpoint removal takes seconds to reach every router; without a preStop wait, vLLM starts its "
        "drain at once and answers every request that still arrives with HTTP 500. A model server "
        "without a drain hook is the failure this tool exists to catch.",
    ),
    Rule(
        "PRESTOP-002",
        E,
        "drain-wait arguments invalid",
        "drain-wait exits at once on arguments it cannot parse, so the hook waits for nothing.",
    ),
    Rule(
        "PRESTOP-003",
        W,
        "drain-wait leaves no time to drain",
        "With --propagation-allowance at or past --deadline, drain-wait never waits for in-flight requests.",
    ),
    Rule(
        "PRESTOP-004",
        W,
        "drain-wait reads another port than vLLM serves",
        "drain-wait then sees no engine: it sleeps the propagation allowance blind and stops early.",
    ),
    Rule(
        "PRESTOP-005",
        W,
        "a prefill replica's drain-wait does not wait for its KV to be pulled",
        "A prefill-only replica (llm-d.ai/role: prefill) looks idle to its engine while decode replicas "
        "still have its KV to pull; without --pulls-url, drain-wait lets the engine stop and each of "
        "those decodes fails (vLLM's kv_load_failure_policy: fail).",
    ),
    Rule(
        "PICKER-001",
        W,
        "a single picker replica",
        "A picker restart (rollout, node drain) then leaves the pool without a picker: with FailClose "
        "every request fails until it is back, with FailOpen routing ignores drains.",
    ),
    Rule(
        "PICKER-002",
        W,
        "picker readiness not on the gRPC readiness service",
        "The picker turns `readiness` (and `inference-extension`) NOT_SERVING when it starts draining; "
        "a probe elsewhere keeps "
        "sending it new streams while it drains.",
    ),
    Rule(
        "PICKER-004",
        E,
        "peers without a credential",
        "The pickers share their books over the peer port (--peers or --peers-service), which listens "
        "on the pod network: without the pickers' own credential (PICKER_PEERS__SECRET from a Secret, or "
        "--peer-secret-file), or with --peers-allow-unauthenticated, any pod in the cluster could write "
        "in their books. A picker without one refuses to start; create the Secret (config/k8s/picker.yaml).",
    ),
    Rule(
        "PICKER-003",
        E,
        "picker liveness on a service that drains",
        "'', `readiness`, `inference-extension` and the ext_proc service turn NOT_SERVING while the "
        "picker drains; a liveness probe on them (as the reference charts' on `inference-extension`) "
        "restarts the picker mid-drain. Only `liveness` stays SERVING.",
    ),
    Rule(
        "ROLLOUT-001",
        W,
        "rollout drops a large share of capacity",
        "maxUnavailable takes replicas out before their replacements are ready; with few replicas the "
        "rest take their load and queues grow during every rollout.",
    ),
    Rule(
        "ROLLOUT-002",
        E,
        "rollout cannot progress",
        "maxSurge and maxUnavailable are both 0: the API server rejects it, and no pod could be replaced.",
    ),
    Rule(
        "ROLLOUT-003",
        W,
        "Recreate strategy",
        "Recreate stops every replica at once: the whole pool drains together and serves nothing until "
        "the new pods have loaded the model.",
    ),
    Rule(
        "ROLLOUT-004",
        W,
        "canary where no gate sees a first token",
        "The pickers run a canary (--rollout-candidate) behind an Envoy config where no ext_proc filter "
        "sees a response body: the TTFT and ITL gates cannot judge there (they say 'unobservable'), and "
        "without Envoy's gRPC access log to the picker neither can the cut gate, so the candidate is "
        "judged by its 5xx answers alone. Add the observer filter (config/envoy.yaml) for every gate.",
    ),
    Rule(
        "PDB-001",
        W,
        "no PodDisruptionBudget for the model servers",
        "A node drain or autoscaler may then evict every replica at once.",
    ),
    Rule(
        "PDB-002",
        W,
        "no PodDisruptionBudget for the picker",
        "A node drain may then evict every picker replica at once.",
    ),
    Rule(
        "PDB-003",
        W,
        "PodDisruptionBudget allows no disruption",
        "Node drains then block until someone forces them, and forced drains skip the grace period.",
    ),
    Rule(
        "PROBE-001",
        E,
        "liveness can kill a loading engine",
        "Without a startupProbe the liveness probe runs while the model loads, and restarts the engine "
        "before it ever becomes ready.",
    ),
    Rule(
        "PROBE-002",
        W,
        "startupProbe shorter than a model load",
        "The kubelet restarts an engine whose startupProbe budget ends before the model has loaded.",
    ),
    Rule(
        "PROBE-003",
        W,
        "model server without a readinessProbe",
        "The pod is then ready (and in the pool) as soon as it starts, long before the model is loaded.",
    ),
    Rule(
        "POOL-001",
        E,
        "InferencePool / Gateway / HTTPRoute malformed",
        "The API server rejects the object, or the gateway ignores it.",
    ),
    Rule(
        "POOL-002",
        W,
        "InferencePool selects no model server",
        "No workload in the inputs has pod labels matching the pool's selector: the pool would be empty.",
    ),
    Rule(
        "POOL-003",
        W,
        "reference to nothing in the inputs",
        "The referenced Service, pool or Gateway is not among the checked manifests.",
    ),
    Rule(
        "POOL-004",
        E,
        "InferencePool targets a port vLLM does not serve",
        "Every routed request would then fail to connect.",
    ),
    Rule(
        "POOL-005",
        E,
        "picker serves another pool than the one routing to it",
        "The InferencePool's endpointPickerRef Service selects a picker whose --pool-name names another "
        "pool: it picks from that pool's pods, which the gateway does not route to.",
    ),
    Rule(
        "POOL-006",
        E,
        "picker's Service selects other pods than the pool",
        "With --kube-service the picker picks from that Service's endpoints; a selector other than the "
        "InferencePool's sends requests to pods outside the pool (or never to some of its pods).",
    ),
    Rule(
        "POOL-007",
        E,
        "InferencePool targets a port the pods do not declare",
        "Each targetPorts number is one endpoint per pod; a port no container of the pool's pods "
        "declares is most likely a typo, and every request sent there fails to connect.",
    ),
    Rule(
        "POOL-008",
        E,
        "picker's RBAC misses what its endpoint source reads",
        "The picker lists and watches its source (--pool-name: pods, inferencepools, "
        "inferenceobjectives; --kube-service: endpointslices); without the grant every list is a 403 "
        "and it never learns of an endpoint, or of a drain. With --drains-configmap it also needs "
        "get/list/watch/create/update on that ConfigMap, or admin drains are not shared.",
    ),
    Rule(
        "ADMIN-001",
        I,
        "admin port without a token",
        "Without an admin token (PICKER_ADMIN__TOKEN from a Secret, or --admin-token) the picker takes "
        "drains, undrains and rollout commands from any loopback caller, and `kubectl port-forward`, "
        "which the status page's guide uses, arrives from loopback: whoever may port-forward to the "
        "picker may drain a replica. A web page in the operator's browser cannot (the admin API refuses "
        "cross-site requests), but a local process can. Set a token to require it of every caller.",
    ),
    Rule(
        "ADMIN-002",
        E,
        "picker's RBAC cannot review its readers",
        "With --metrics-endpoint-auth (admin.metrics_auth) the picker asks the API server about every "
        "new reader's token: a TokenReview (who is it) and a SubjectAccessReview (may it get /metrics). "
        "Both are cluster-scoped creates, granted only by a ClusterRole bound with a "
        "ClusterRoleBinding (config/k8s/metrics-auth); without them every scrape, and every admin read "
        "under admin.read_auth `metrics`, is answered 503.",
    ),
    Rule(
        "POOL-009",
        W,
        "several picker replicas that do not share their books",
        "Envoy spreads a request's ext_proc streams over the picker replicas on its own, so without "
        "--peers-service / --peers (one set of books) or --ha-enable-leader-election (one active) each "
        "replica sees the end of only some of its requests: in-flight counts, load spread and drain "
        'records hold for a fraction of the traffic (docs, "Two pickers").',
    ),
    Rule(
        "POOL-010",
        E,
        "picker ranks pods for scale-downs without patch on pods",
        "With --pod-deletion-cost (kube.deletion_cost) the picker writes each pool pod's "
        "controller.kubernetes.io/pod-deletion-cost annotation, so the ReplicaSet controller deletes "
        "the replica with the least work first; it refuses to start without patch on pods in its "
        "namespace (config/k8s/deletion-cost adds the Role).",
    ),
    Rule(
        "AUTOSCALE-001",
        E,
        "autoscaler malformed",
        "The API server rejects the ScaledObject (KEDA reads its triggers' metadata as strings), or "
        "KEDA cannot scale from it.",
    ),
    Rule(
        "AUTOSCALE-002",
        E,
        "autoscaler not aimed at the model servers",
        "The pool's signals (picker_pool_*) measure the model servers' demand and capacity: an HPA or "
        "ScaledObject whose scaleTargetRef names the pickers, or a workload that serves no pool, adds "
        "replicas that take none of that demand.",
    ),
    Rule(
        "AUTOSCALE-003",
        E,
        "autoscaler reads a metric the picker does not export",
        "A query naming no picker family returns no data: KEDA then scales as if the demand were 0 "
        "(or errs with ignoreNullValues false), an HPA holds its replicas. A family renamed since the "
        "query was written does the same (docs/reference/metrics.md lists them).",
    ),
    Rule(
        "ROUTE-001",
        E,
        "HTTPRoute timeout below the longest stream",
        "The gateway cuts every stream that outlives the route timeout.",
    ),
    Rule(
        "ROUTE-002",
        I,
        "HTTPRoute timeout left to the implementation",
        "Without timeouts.request the gateway's default applies (Envoy's own route default is 15 s); "
        "set 0s or at least the longest stream.",
    ),
    # Envoy
    Rule(
        "ENVOY-001",
        E,
        "route timeout cuts long streams",
        "Envoy's route timeout (15 s unless set) and max_stream_duration end a stream mid-generation; "
        "use 0s or more than the longest stream.",
    ),
    Rule(
        "ENVOY-002",
        E,
        "idle timeout below the longest silence",
        "stream_idle_timeout (300 s unless set) and the route idle_timeout reset a stream that is silent "
        "for longer, e.g. a long prefill or a queued request before its first token.",
    ),
    Rule(
        "ENVOY-003",
        E,
        "circuit breakers below the expected streams",
        "Every open stream holds one request (and, to HTTP/1 vLLM, one connection) for its whole life; "
        "past the threshold (1024 unless set) Envoy answers 503 UO.",
    ),
    Rule(
        "ENVOY-004",
        W,
        "retries on upstream 500",
        "Envoy never retries once response headers were sent, so retries cannot duplicate tokens; but "
        "a 500 is how vLLM reports a request that crashed its engine (retrying spreads it to the next "
        "replica) and a non-streaming request that failed after its generation ran (retrying runs it "
        "again). Retry connect failures, resets and 503; a 500 only with the previous_hosts predicate "
        "and num_retries <= 2 (the shipped config: vLLM's drain 500 comes before any token, and a "
        "query of death reaches at most 3 replicas, each once).",
    ),
    Rule(
        "ENVOY-005",
        E,
        "picker metadata dropped",
        "Without metadata_options.receiving_namespaces.untyped: [envoy.lb] Envoy silently drops the "
        "picker's endpoint list: routing degrades to round robin, draining endpoints included.",
    ),
    Rule(
        "ENVOY-006",
        E,
        "forged routing header not removed",
        "A client-sent x-gateway-destination-endpoint reaches gateways that route on the header when the "
        "picker does not overwrite it (e.g. failing open): any ip:port of the client's choice.",
    ),
    Rule(
        "ENVOY-007",
        E,
        "routing filter holds the response body",
        "FULL_DUPLEX_STREAMED makes a picker restart reset every stream and disables message_timeout; "
        "BUFFERED holds the whole stream until it ends. Use NONE (and an observer filter).",
    ),
    Rule(
        "ENVOY-008",
        W,
        "every token waits for the picker",
        "response_body_mode STREAMED on the routing filter sends each chunk through the picker: a slow "
        "picker stalls every stream, and with fail-closed a picker crash resets them.",
    ),
    Rule(
        "ENVOY-009",
        E,
        "removed hosts keep getting traffic",
        "An EDS cluster with active health checks keeps a removed host that still passes them (vLLM's "
        "/health stays 200 while it drains) unless ignore_health_on_host_removal is true.",
    ),
    Rule(
        "ENVOY-010",
        W,
        "failure mode differs from the InferencePool's",
        "The ext_proc failure_mode_allow and the pool's failureMode should say the same thing, or the "
        "behaviour with the picker down is not the one documented.",
    ),
    Rule(
        "ENVOY-011",
        W,
        "picker cannot see the request body",
        "The picker picks from the body (model, size); with request_body_mode NONE or STREAMED it "
        "decides on the headers alone: the model is unknown and bad or oversized bodies reach the "
        "model servers. Use BUFFERED, BUFFERED_PARTIAL or FULL_DUPLEX_STREAMED.",
    ),
    Rule(
        "ENVOY-012",
        E,
        "fallback list for an ORIGINAL_DST pool",
        "An ORIGINAL_DST cluster (Envoy AI Gateway FailClose pools, kgateway, the GIE guides' Envoy) "
        "routes to exactly one ip:port and answers a list with 503 no healthy upstream. The routing "
        "filter's initial_metadata x-picker-data-plane: override-host makes the picker list fallbacks: "
        "drop it for such a pool (the picker then sends one endpoint).",
    ),
    Rule(
        "ENVOY-013",
        E,
        "FULL_DUPLEX_STREAMED without trailers SEND",
        "Envoy rejects an ext_proc filter whose request or response body is FULL_DUPLEX_STREAMED "
        "unless the trailer mode of the same side is SEND.",
    ),
    Rule(
        "ENVOY-014",
        W,
        "picker cannot see where responses end",
        "With response_body_mode NONE, no observer filter and no gRPC access log to the picker, it never "
        "learns how a stream ends: a request counts on its replica by the picker's own books only until "
        "the engine's scraped running + waiting gauges can show it, its end is inferred when they drop, "
        "and drain records close when the engine is idle. Routing stays as good (docs, 'Benchmarks': "
        "bench_shapes), but the view lags by a scrape interval and end reasons read `unobserved`: add "
        "the observer filter or Envoy's gRPC access log to the picker for exact counts and reasons.",
    ),
    Rule(
        "ENVOY-015",
        W,
        "failClose without the contract reply",
        "With failure_mode_allow false and the picker unreachable, Envoy answers status_on_error with an "
        "empty body and no Retry-After, so clients following the status contract never retry the one "
        "503 that is always safe to retry. Give status_on_error a code nothing else answers with and a "
        "local_reply_config mapper that restates it as 503 picker-unavailable (config/envoy.yaml).",
    ),
    Rule(
        "ENVOY-016",
        E,
        "picker cluster circuit breakers below the expected streams",
        "Every ext_proc filter holds one gRPC stream per request on the picker's cluster: an observer's "
        "for the whole response, a routing filter's until the response headers (a queued request's for "
        "its whole wait). Past its max_requests (1024 unless set) Envoy refuses the stream: a "
        "fail-closed filter answers 503 picker-unavailable, a fail-open one or an observer lets the "
        "request pass unrouted or untracked. Set the cluster's circuit_breakers max_requests to at "
        "least the expected streams times its filters (config/envoy.yaml).",
    ),
)
RULES: dict[str, Rule] = {rule.id: rule for rule in _CATALOGUE}


@dataclass(frozen=True)
class Budget:
    """What the manifests do not say; each has a CLI flag."""

    longest_stream_s: float = 300.0
    longest_silence_s: float = 60.0
    expected_concurrent_streams: int = 4096
    cleanup_margin_s: float = 10.0
    model_load_s: float = 600.0


@dataclass(frozen=True)
class Finding:
    rule: Rule
    file: str
    line: int | None
    obj: str
    field: str
    message: str

    def as_json(self) -> dict[str, Any]:
        return {
            "rule": self.rule.id,
            "severity": str(self.rule.severity),
            "file": self.file,
            "line": self.line,
            "object": self.obj,
            "field": self.field,
            "message": self.message,
            "why": self.rule.why,
        }


@dataclass(frozen=True)
class Skipped:
    rule_id: str
    file: str
    obj: str
    reason: str

    def as_json(self) -> dict[str, Any]:
        return {"rule": self.rule_id, "file": self.file, "object": self.obj, "reason": self.reason}


@dataclass
class Report:
    findings: list[Finding] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)

    def add(self, rule_id: str, doc: Document, path: FieldPath, message: str) -> None:
        self.findings.append(
            Finding(RULES[rule_id], str(doc.file), doc.line_of(path), doc.label, format_path(path), message)
        )

    def skip(self, rule_id: str, doc: Document, reason: str) -> None:
        self.skipped.append(Skipped(rule_id, str(doc.file), doc.label, reason))

    def count(self, severity: Severity) -> int:
        return sum(1 for f in self.findings if f.rule.severity is severity)
