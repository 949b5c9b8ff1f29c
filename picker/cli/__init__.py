"""The command line: `picker serve | proxy | check | drain-wait | rollout | demo ...` (`main.py`),
the demos (`demo.py`, `demo_proxy.py`), the Envoy configs they render (`envoyconf.py`) and the
generator of the docs' reference pages (`reference_pages.py`). The outermost layer: it may import
anything; nothing imports it."""
