"""The admin API: the operator's door into a running picker (authenticated, validated whole).

`api.py` serves it (endpoints, drains, rollouts, status JSON), `status_page.py` and `static/` the
live status page, `capacity_guard.py` the check that refuses a drain that would leave the pool too
little capacity. An edge: it calls the core and the sources; the core never imports it.
"""
