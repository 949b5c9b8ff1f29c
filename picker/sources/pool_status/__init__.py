"""kube.pool_status: the picker's health written on its InferencePool, as a `Ready` condition in the
picker's own `status.parents` entry and events on changes of state, drains and rollbacks.

Inside: `writer` decides when and what to write (the loop, its bounds, the refusals it counts),
`body` shapes what is written (pure), `api` talks to the API server (lightkube; imported only where
the status is written, so the rest of the picker never loads it), `opening` makes the writer from
the core. The writer's names are here.
"""

from picker.sources.pool_status.writer import (
    Grants,
    PoolStatusRefused,
    PoolStatusWriter,
    StatusApi,
    verified,
)

__all__ = ["Grants", "PoolStatusRefused", "PoolStatusWriter", "StatusApi", "verified"]
