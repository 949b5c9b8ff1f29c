"""The rollout's tables: what clients saw per setup, and the picker's scorecard for each drain."""

from __future__ import annotations

from collections.abc import Sequence

from loadtest.rollout.load import LoadReport
from loadtest.rollout.rolling import SetupRun
from picker.drain import scorecard

_ROWS = (
    ("sent", "requests sent (same seeded Poisson arrivals in every run)"),
    ("completed", "streams that ended with [DONE] and finish_reason length/stop"),
    ("http_5xx", "HTTP 5xx from a replica or Envoy, by code"),
    ("truncated", "HTTP 200 streams cut before [DONE]"),
    ("aborted", "silently aborted: finish_reason abort"),
    ("hung", "no byte for the read timeout (10 s)"),
    ("conn_errors", "connection refused/reset before any status"),
    ("contract", "the picker's contract replies (status + x-picker-dropped-reason)"),
    ("ttft_p50", "time to first token of completed streams, p50 (ms)"),
    ("ttft_p99", "time to first token of completed streams, p99 (ms)"),
)


def client_view(load: LoadReport) -> dict[str, str]:
    kinds = load.kinds()
    http = {k.removeprefix("http-"): v for k, v in sorted(kinds.items()) if k.startswith("http-")}
    contract = load.contract_reasons()
    return {
        "sent": str(len(load.outcomes)),
        "completed": str(kinds.get("completed", 0)),
        "http_5xx": ", ".join(f"{code}: {n}" for code, n in http.items()) or "0",
        "truncated": str(kinds.get("truncated", 0)),
        "aborted": str(kinds.get("abort", 0)),
        "hung": str(kinds.get("hung", 0)),
        "conn_errors": str(kinds.get("conn-error", 0)),
        "contract": ", ".join(f"{reason}: {n}" for reason, n in sorted(contract.items())) or "0",
        "ttft_p50": f"{load.ttft_ms(50):.0f}",
        "ttft_p99": f"{load.ttft_ms(99):.0f}",
    }


def failed(load: LoadReport) -> int:
    return len(load.outcomes) - load.kinds().get("completed", 0)


def verdict(run: SetupRun) -> str:
    total, bad = len(run.load.outcomes), failed(run.load)
    before, after = run.load_avg
    cpu = ", ".join(f"{name} {seconds:.1f}" for name, seconds in run.cpu_s.items())
    return (
        f"{total - bad} of {total} requests completed, {bad} failed; rollout took {run.rollout_s:.1f} s "
        f"(CPU s: {cpu}; machine load average {before:.1f} -> {after:.1f})"
    )


def side_by_side(
    titles: Sequence[str], columns: Sequence[dict[str, str]], rows: Sequence[tuple[str, str]], min_cell: int
) -> str:
    """A legend naming each column (a), (b), ..., then one line per (key, label) with every
    column's figure: the layout every side-by-side benchmark prints."""
    heads = [f"({chr(ord('a') + i)})" for i in range(len(columns))]
    width = max(len(key) for key, _ in rows) + 2
    cell = max(min_cell, *(len(col[key]) + 2 for col in columns for key, _ in rows))
    lines = [" " * width + "".join(h.ljust(cell) for h in heads)]
    for key, label in rows:
        lines.append(key.ljust(width) + "".join(col[key].ljust(cell) for col in columns) + f"  {label}")
    legend = [f"  {h} {title}" for h, title in zip(heads, titles, strict=True)]
    return "\n".join([*legend, "", *lines])


def clients_table(runs: Sequence[SetupRun]) -> str:
    """One column per setup, one row per kind of outcome."""
    columns = [client_view(run.load) for run in runs]
    return side_by_side([run.title for run in runs], columns, _ROWS, 14)


def drains_table(run: SetupRun) -> str:
    if run.drains is None:
        return "(no picker in this setup: no drain records)"
    return scorecard.table(run.drains)
