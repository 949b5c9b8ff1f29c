"""The Envoy ext_proc frontend: gRPC in, core calls out.

Two kinds of ext_proc stream reach the same service. The routing filter (request headers + buffered
body + response headers; response body NONE) asks where to send a request. An observer filter in
`observability_mode` streams the response body without blocking it, so the picker learns when each
stream really ends while a picker crash cuts no stream. The two are joined by a request id the picker
sets on the routed request. All protobuf stays in `translate.py`.
"""
