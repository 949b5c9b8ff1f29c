"""config/k8s/pool-status (issue 55, item 3): the overlay turns on --pool-status and ships the Role it
needs: patch on the InferencePool's status subresource and create on events, nothing more."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.drain.overlays import overlay_rbac, serve_config, with_overlay
from tests.drain.test_check import check, ids

OVERLAY = "pool-status"


def rbac() -> list[dict[str, Any]]:
    return overlay_rbac(OVERLAY)


def test_the_overlay_grants_only_the_status_and_events() -> None:
    (role,) = [d for d in rbac() if d["kind"] == "Role"]
    assert role["rules"] == [
        {
            "apiGroups": ["inference.networking.k8s.io"],
            "resources": ["inferencepools/status"],
            "verbs": ["patch"],
        },
        {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create"]},
    ]


def test_the_overlay_passes_and_the_picker_reads_the_flag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = with_overlay(OVERLAY)
    assert ids(check(m.write(tmp_path))) == set()
    config = serve_config(m, monkeypatch)
    assert config.kube.pool_status and config.kube.pool_name == "vllm-llama"
    assert config.kube.pool_status_debounce_s == 0.5
