"""Comments and docstrings in the package state the contract and the reason: a measured figure, a date,
a project issue number or a review's history is stale by the next change. Figures live on the
benchmarks page (docs/benchmarks.md), history in the commit log. The patterns are narrow on purpose:
a version a fact was seen on ("measured on vLLM 0.32"), a default ("50 ms to a first token") or an
upstream project's issue (gateway-api-inference-extension#2925) is no stale figure."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "picker"

# a component and its version (where a fact was seen), an HTTP status: numbers, not figures
_NOT_FIGURES = re.compile(
    r"\b(?:vLLM|Envoy|Python|Kubernetes|GIE|CPython)\s+v?\d+(?:\.\d+)*|\bHTTP \d{3}\b", re.I
)
PATTERNS = {
    # this project's issues and stops: history, the log's to keep
    "an issue number": re.compile(r"(?<![\w-])issues? #?\d+|\bstop \d+\b", re.I),
    "a date": re.compile(
        r"\b20\d\d-\d\d-\d\d\b|\b(?:January|February|March|April|May|June|July|August|September|"
        r"October|November|December) 20\d\d\b"
    ),
    # "(1.4 -> 0.31 us)": a before and after
    "a before/after figure": re.compile(r"\d[\d.,]*\s*(?:[a-zµ%]+\s*)?(?:->|→)\s*\d"),
    # "measured: 0.5 ms less", "211 to 141 us, measured"
    "a measured figure": re.compile(r"\bmeasured\b[^.;)\n]*?\d|\d[^.;(\n]*\bmeasured\b", re.I),
    # a cost in microseconds: the hot path's figures, which move with every change
    "a microsecond figure": re.compile(r"\b\d[\d.,]*\s?(?:us|µs)\b"),
    "review history": re.compile(r"\bfound by the review\b|\bthe review found\b", re.I),
}


def findings(text: str) -> list[tuple[int, str, str]]:
    """(line, what, the words) for each comment or docstring of `text` that carries one of them."""
    found = []
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        body = token.string
        docstring = token.type == tokenize.STRING and body.lstrip("rbuRBU")[:3] in ('"""', "'''")
        if token.type != tokenize.COMMENT and not docstring:
            continue
        plain = _NOT_FIGURES.sub("", body)
        for what, pattern in PATTERNS.items():
            for match in pattern.finditer(plain):
                line = token.start[0] + plain[: match.start()].count("\n")
                found.append((line, what, plain[max(0, match.start() - 30) : match.end() + 10]))
    return found


def test_no_comment_in_the_package_carries_a_figure_a_date_or_history() -> None:
    stale = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {what}: {words!r}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line, what, words in findings(path.read_text())
    ]
    assert stale == [], "say the contract and the reason instead:\n" + "\n".join(stale)


@pytest.mark.parametrize(
    "text",
    [
        "x = 1  # one Modes each (0.97 -> 0.40 us)\n",
        '"""Fixed in issue 56: the pick."""\n',
        "# measured: 0.5 ms less from the replica's headers\n",
        "# went from 211 to 141-163 us, measured with two pickers\n",
        '"""Taken on 2026-12-07."""\n',
        "# a lookup 0.05 us\n",
    ],
)
def test_the_check_sees_each_kind(text: str) -> None:
    assert findings(text)


@pytest.mark.parametrize(
    "text",
    [
        "# vLLM's answer once SIGTERM started its drain (HTTP 500, measured on vLLM 0.32)\n",
        "# A pool with no observation yet: 50 ms to a first token\n",
        '"""Proposed upstream (gateway-api-inference-extension#2925)."""\n',
        'x = "measured 3 times"  # a plain string is no comment\n',
    ],
)
def test_the_check_lets_facts_and_defaults_be(text: str) -> None:
    assert not findings(text)
