"""The documentation site: the generated reference pages say what the code says, the site builds with
`mkdocs build --strict` (a broken link or a missing page fails), and README stays a front page whose
links all lead somewhere."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from picker.cli.reference_pages import PAGES

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(PAGES))
def test_each_generated_page_matches_the_code(name: str) -> None:
    page = ROOT / "docs" / "reference" / name
    assert page.exists(), f"{page} missing: run `python -m picker.cli.reference_pages`"
    assert page.read_text() == PAGES[name](), f"{page} is stale: run `python -m picker.cli.reference_pages`"


def test_the_site_builds_strict(tmp_path: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "-q",
            "-f",
            str(ROOT / "mkdocs.yml"),
            "-d",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "reference" / "metrics" / "index.html").exists()


def test_every_page_is_in_the_navigation() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert {p for p in pages if p not in nav} == set()


def test_readme_is_a_front_page_whose_links_resolve() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert targets, "the front page links to the documentation"
    missing = [t for t in targets if not t.startswith("http") and not (ROOT / t).exists()]
    assert missing == []
