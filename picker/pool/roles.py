"""Prefill / decode roles: which part of a request an endpoint serves in a disaggregated pool.

A role is read from the endpoint's labels (a pod's, or the endpoints file's `role:` field): the
label configured in `pd.role_label` first, then the llm-d label `llm-d.ai/role`. An endpoint with no
role label serves both parts, as every endpoint of a pool without roles does: a pool is routed as
pairs only once some endpoint says it serves prefill alone (`Role.PREFILL`).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence

LLM_D_ROLE = "llm-d.ai/role"


class Role(enum.Enum):
    PREFILL = "prefill"  # computes prompts and hands their KV to a decode replica; never a destination
    DECODE = "decode"  # the destination: pulls a prompt's KV (or computes it) and streams the answer
    BOTH = "both"  # either part, or both: an ordinary replica

    @property
    def decodes(self) -> bool:
        return self is not Role.PREFILL

    @property
    def prefills(self) -> bool:
        return self is not Role.DECODE


_VALUES = {role.value: role for role in Role}
_VALUES["prefill-decode"] = Role.BOTH  # llm-d's spelling of a replica serving both


def role_of(labels: Mapping[str, str] | None, keys: Sequence[str] = (LLM_D_ROLE,)) -> Role | None:
    """The role the first present key of `keys` names; BOTH with no such key; None when the value
    names no role (the caller counts it and keeps the endpoint out of pairs)."""
    if not labels:
        return Role.BOTH
    for key in keys:
        value = labels.get(key)
        if value is not None:
            return _VALUES.get(value.strip().lower())
    return Role.BOTH
