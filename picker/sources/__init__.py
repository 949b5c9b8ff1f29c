"""Adapters that feed the pool from the outside world: endpoint sources and the load scraper.

The only place (with the frontends) that does network or file I/O on the pool's behalf. Each source
is a long-running task wrapped around small finite steps that tests drive directly.
"""
