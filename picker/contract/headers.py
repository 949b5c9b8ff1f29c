"""Every header name and metadata key the picker reads or writes, in one place.

The destination names follow the Gateway API Inference Extension endpoint-picker protocol, so any
Envoy-based gateway that speaks it can route on the picker's answer.
"""

from typing import Final

# Routing answer: primary endpoint first, then fallbacks, as "ip:port,ip:port".
DESTINATION: Final = "x-gateway-destination-endpoint"
# Written by Envoy's override_host policy (selected_host_key): the endpoint that really served.
DESTINATION_SERVED: Final = "x-gateway-destination-endpoint-served"
# Dynamic-metadata namespace the override_host LB policy reads (clients cannot forge metadata).
LB_METADATA_NAMESPACE: Final = "envoy.lb"
# EPP protocol: the data plane may restrict a request to these endpoints (a list of "ip:port").
SUBSET_HINT_NAMESPACE: Final = "envoy.lb.subset_hint"
DESTINATION_SUBSET: Final = "x-gateway-destination-endpoint-subset"

# gRPC metadata on the routing filter's ext_proc stream (grpc_service.initial_metadata): the data
# plane declares that it reads the destination with override_host, so a fallback list is safe.
DATA_PLANE: Final = "x-picker-data-plane"
OVERRIDE_HOST: Final = "override-host"

# Set by the picker on every routed request so the observer stream of the same request can be joined.
PICKER_REQUEST_ID: Final = "x-picker-request-id"
# Why the picker refused a request (values: picker.contract.Outcome); same values as the llm-d router.
DROPPED_REASON: Final = "x-picker-dropped-reason"
RETRY_AFTER: Final = "retry-after"
CONTENT_TYPE: Final = "content-type"

# W3C trace context: continued from the client, forwarded to the replica naming the picker's span.
TRACEPARENT: Final = "traceparent"
TRACESTATE: Final = "tracestate"
TRACE_CONTEXT: Final = (TRACEPARENT, TRACESTATE)

# Client-supplied scheduling hints: read by the picker, removed before the request leaves Envoy.
REQUEST_ID: Final = "x-request-id"
FAIRNESS_ID: Final = "x-gateway-inference-fairness-id"
PRIORITY: Final = "x-gateway-inference-priority"
# GIE v1: the InferenceObjective (its metadata.name) whose spec.priority the request gets.
OBJECTIVE: Final = "x-gateway-inference-objective"
CLIENT_HINTS: Final = (FAIRNESS_ID, PRIORITY)
# Prefill / decode pools: the prefill replica ("ip:port") the destination (a decode replica) asks
# for the prompt's KV, the llm-d router's name, read by its routing sidecar and vLLM's P/D proxies.
# Set only by the picker: a client's is removed, so a request cannot name where its prompt goes.
PREFILLER: Final = "x-prefiller-host-port"
CLIENT_ROUTING: Final = (
    *CLIENT_HINTS,
    PREFILLER,
)  # removed from every routed request the picker names no prefill for
# Per-request latency objectives, in milliseconds (the reference picker's spellings; read with
# affinity.latency on): route to a replica predicted to meet them, or shed a sheddable request.
# picker proxy, streams.resume: `on` asks for a stream to be continued on another replica if its
# own is cut, `off` refuses it (picker/streams/resume.py); never sent upstream
RESUME: Final = "x-picker-resume"
RESUME_REFUSED: Final = "x-picker-resume-refused"  # the answer to one that asked and cannot: why
SLO_TTFT: Final = ("x-slo-ttft-ms", "x-llm-d-slo-ttft-ms")
SLO_TPOT: Final = ("x-slo-tpot-ms", "x-llm-d-slo-tpot-ms")

# GIE conformance suite hooks (only with --enable-test-hooks): the endpoints a test allows, and the
# endpoint that served, echoed to the test client.
TEST_ENDPOINT_SELECTION: Final = "test-epp-endpoint-selection"
TEST_SERVED_ENDPOINT: Final = "x-conformance-test-served-endpoint"

# HTTP/2 pseudo-headers as Envoy passes them to ext_proc.
PATH: Final = ":path"
METHOD: Final = ":method"
STATUS: Final = ":status"

# `picker proxy`: hop-by-hop headers (RFC 9110 7.6.1) never forwarded, either way, plus the ones the
# proxy sets itself (host, content-length).
HOP_BY_HOP: Final = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "http2-settings",
    }
)
# Request headers an HTTP client library adds on its own when the caller sent none: the proxy
# suppresses them so the model server sees the client's request as it was.
CLIENT_LIBRARY_DEFAULTS: Final = ("Accept", "Accept-Encoding", "User-Agent")
