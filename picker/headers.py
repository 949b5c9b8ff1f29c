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

# Set by the picker on every routed request so the observer stream of the same request can be joined.
PICKER_REQUEST_ID: Final = "x-picker-request-id"
# Why the picker refused a request (values: picker.contract.Outcome); same values as the llm-d router.
DROPPED_REASON: Final = "x-picker-dropped-reason"
RETRY_AFTER: Final = "retry-after"
CONTENT_TYPE: Final = "content-type"

# Client-supplied scheduling hints.
REQUEST_ID: Final = "x-request-id"
FAIRNESS_ID: Final = "x-gateway-inference-fairness-id"
PRIORITY: Final = "x-gateway-inference-priority"

# HTTP/2 pseudo-headers as Envoy passes them to ext_proc.
PATH: Final = ":path"
METHOD: Final = ":method"
STATUS: Final = ":status"
