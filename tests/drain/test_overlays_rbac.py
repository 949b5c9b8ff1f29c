"""Every overlay's RBAC against the Kubernetes schema (each overlay's own rules: its test file)."""

from __future__ import annotations

from typing import Any

import kubernetes_validate.utils as kubernetes_validate
import pytest

from tests.drain.overlays import overlay_rbac
from tests.drain.test_manifests import KUBERNETES_VERSION

OVERLAYS = ("deletion-cost", "metrics-auth", "pool-status")
DOCS = [(overlay, doc) for overlay in OVERLAYS for doc in overlay_rbac(overlay)]


@pytest.mark.parametrize(
    ("overlay", "doc"), DOCS, ids=[f"{o}:{d['kind']}/{d['metadata']['name']}" for o, d in DOCS]
)
def test_the_overlays_rbac_matches_the_kubernetes_schema(overlay: str, doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
