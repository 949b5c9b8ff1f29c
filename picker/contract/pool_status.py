"""What the picker says about its pool on the InferencePool: the condition it writes and the
reasons it gives, the events it records. Operators and controllers read these strings, so they are
part of the contract and live here, once.

The condition type is `Ready`, the name proposed for an InferencePool's runtime health in the
Gateway API Inference Extension (gateway-api-inference-extension#2925: `Ready=True` when the pool
can serve, `Ready=False` with a reason that tells a configuration failure from a runtime one).
Reasons are CamelCase, as `metav1.Condition.reason` requires.
"""

from __future__ import annotations

import enum

CONDITION_TYPE = "Ready"
REPORTING_CONTROLLER = "inference-picker"  # every Event's reportingController; and its
# reportingInstance where the picker has no name of its own (the API server refuses an empty one)


class PoolState(enum.Enum):
    """What the picker makes of its pool (closed set; picker/pool/status.py decides it)."""

    READY = "ready"  # at least one endpoint takes new work
    DEGRADED = "degraded"  # none does: every request waits or is refused (503 rejected-no-endpoints)
    STOPPING = "stopping"  # the picker is shutting down


class PoolReason(enum.Enum):
    """The condition's `reason` (closed set)."""

    READY = "Ready"
    NO_READY_ENDPOINTS = "NoReadyEndpoints"  # none listed, or none ready (starting, failing probes)
    ALL_DRAINING = "AllDraining"  # every listed endpoint drains (a rollout or scale-down took them all)
    SOURCE_UNAVAILABLE = "EndpointSourceUnavailable"  # the pool's own object cannot be read or used
    STOPPING = "Stopping"


# The condition's `status` for each state: metav1.ConditionStatus values (no Unknown: the writer
# starts after the source's first load or first attempt, and an empty view is a reading too).
CONDITION_STATUS = {
    PoolState.READY: "True",
    PoolState.DEGRADED: "False",
    PoolState.STOPPING: "False",
}


class PoolEvent(enum.Enum):
    """The `reason` of an Event about the pool (events.k8s.io/v1; closed set)."""

    READY = "PoolReady"
    DEGRADED = "PoolDegraded"
    STOPPING = "PickerStopping"
    DRAINING = "EndpointDraining"
    ROLLED_BACK = "RolloutRolledBack"


# The Event's `type`: Normal or Warning.
EVENT_TYPE = {
    PoolEvent.READY: "Normal",
    PoolEvent.DEGRADED: "Warning",
    PoolEvent.STOPPING: "Normal",
    PoolEvent.DRAINING: "Normal",
    PoolEvent.ROLLED_BACK: "Warning",
}

STATE_EVENT = {
    PoolState.READY: PoolEvent.READY,
    PoolState.DEGRADED: PoolEvent.DEGRADED,
    PoolState.STOPPING: PoolEvent.STOPPING,
}

# The Event's `action`: what the picker did or saw.
EVENT_ACTION = {
    PoolEvent.READY: "ReportHealth",
    PoolEvent.DEGRADED: "ReportHealth",
    PoolEvent.STOPPING: "ReportHealth",
    PoolEvent.DRAINING: "Drain",
    PoolEvent.ROLLED_BACK: "Rollback",
}
