"""A request naming an InferenceObjective is admitted at its priority; the priority header overrides
it; an unknown objective gets the default. Through the ext_proc adapter (no Envoy, no network)."""

from __future__ import annotations

from typing import Any

from picker.contract import headers
from picker.request.objectives import Objectives
from tests.unit.extproc.test_extproc_service import BODY, body, make, request_headers, run


async def test_the_objective_header_sets_the_priority_and_the_priority_header_overrides_it() -> None:
    h = make()
    objectives = Objectives("vllm")
    objectives.apply(
        "ADDED", {"metadata": {"name": "critical"}, "spec": {"poolRef": {"name": "vllm"}, "priority": 10}}
    )
    h.path.objectives = objectives
    seen: list[int] = []
    admit = h.path.admit

    def spy(parsed: Any, **options: Any) -> Any:
        seen.append(options["priority"])
        return admit(parsed, **options)

    h.path.admit = spy  # type: ignore[method-assign]
    for extra in (
        {headers.OBJECTIVE: "critical"},
        {headers.OBJECTIVE: "critical", headers.PRIORITY: "-1"},
        {headers.OBJECTIVE: "unknown"},
        {},
    ):
        await run(h.service, [request_headers(extra), body(BODY)])
    assert seen == [10, -1, 0, 0]
