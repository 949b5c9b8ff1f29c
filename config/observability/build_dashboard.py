"""Build the picker's Grafana dashboard (picker-dashboard.json beside this file) with grafana-foundation-sdk.

    .venv/bin/python config/observability/build_dashboard.py          # rewrite the JSON
    .venv/bin/python config/observability/build_dashboard.py --check  # exit 1 if the JSON is stale

The dashboard is code so that its queries are reviewed like code, and tests/observability checks every
metric it names against the picker's real /metrics page. Rows follow the questions an operator asks
during a rollout: which endpoint is in which state and holds how much; how each drain went; did any
stream get cut or stall; is the admission queue backing up; what latency do clients get; can the
picker still read the model servers' load.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard, prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef, ThresholdsMode
from grafana_foundation_sdk.models.dashboard import Threshold as ThresholdStep

OUTPUT = Path(__file__).resolve().parent / "picker-dashboard.json"
UID = "inference-picker"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE = "$__rate_interval"


def query(expr: str, legend: str = "", ref: str = "A") -> prometheus.Dataquery:
    return (
        prometheus.Dataquery().expr(expr).legend_format(legend or "__auto").ref_id(ref).datasource(DATASOURCE)
    )


def series(title: str, description: str, unit: str, *queries: prometheus.Dataquery) -> timeseries.Panel:
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .unit(unit)
        .height(8)
        .span(12)
        .datasource(DATASOURCE)
        .fill_opacity(10)
    )
    for q in queries:
        panel = panel.with_target(q)
    return panel


def must_stay_zero(title: str, description: str, expr: str) -> stat.Panel:
    """A stat that turns red at 1: a count that should never move."""
    steps = [ThresholdStep(value=None, color="green"), ThresholdStep(value=1, color="red")]
    return (
        stat.Panel()
        .title(title)
        .description(description)
        .height(4)
        .span(6)
        .datasource(DATASOURCE)
        .with_target(query(expr))
        .thresholds(dashboard.ThresholdsConfig().mode(ThresholdsMode.ABSOLUTE).steps(steps))
    )


def quantiles(metric: str, legend: str) -> list[prometheus.Dataquery]:
    return [
        query(
            f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket[{RATE}])))",
            f"{legend} p{int(q * 100)}",
            r,
        )
        for q, r in ((0.5, "A"), (0.99, "B"))
    ]


def build() -> dashboard.Dashboard:
    board = (
        dashboard.Dashboard("inference-picker: endpoints, drains, streams")
        .uid(UID)
        .tags(["inference-picker", "vllm"])
        .refresh("10s")
        .time("now-30m", "now")
        .timezone("browser")
        .with_variable(dashboard.DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
    )
    board = (
        board.with_row(dashboard.Row("Endpoints"))
        .with_panel(
            series(
                "Endpoints by state",
                "Endpoints ready, draining, not ready, or gone (kept until their last request ends).",
                "short",
                query("sum by (state) (picker_endpoint_state)", "{{state}}"),
            )
        )
        .with_panel(
            series(
                "In flight per endpoint",
                "Requests the picker has in flight on each endpoint; a draining endpoint should fall to 0.",
                "short",
                query("picker_endpoint_in_flight", "{{endpoint}}"),
            )
        )
        .with_panel(
            series(
                "Engine load per endpoint (last scrape)",
                "vLLM's running and waiting requests, as the picker last scraped them.",
                "short",
                query("picker_endpoint_engine_running", "{{endpoint}} running"),
                query("picker_endpoint_engine_waiting", "{{endpoint}} waiting", "B"),
            )
        )
        .with_panel(
            series(
                "Ready endpoints",
                "Endpoints the picker may route new work to. 0 means every new request waits or gets 503.",
                "short",
                query("picker_ready_endpoints", "ready"),
            )
        )
    )
    board = (
        board.with_row(dashboard.Row("Drains"))
        .with_panel(
            must_stay_zero(
                "Picks after drain start",
                "New requests sent to an endpoint after its drain began, over the range. Must stay 0.",
                "sum(increase(picker_drain_picks_after_start_total[$__range]))",
            )
        )
        .with_panel(
            must_stay_zero(
                "Drained requests cut",
                "Requests on draining endpoints that did not complete (cut, upstream error), over the range.",
                'sum(increase(picker_drain_request_ends_total{end!~"completed|client-disconnect"}[$__range]))',
            )
        )
        .with_panel(
            must_stay_zero(
                "Picks of not-ready endpoints",
                "Requests picked for, or served by, an endpoint that was not ready, over the range.",
                "sum(increase(picker_picks_not_ready_total[$__range]))",
            )
        )
        .with_panel(
            stat.Panel()
            .title("Open drains")
            .description("Endpoints draining right now.")
            .height(4)
            .span(6)
            .datasource(DATASOURCE)
            .with_target(query("picker_drains_open"))
        )
        .with_panel(
            series(
                "Drains closed, by exit",
                "gone: the endpoint left; ready: it was undrained; others: see the docs' drain records.",
                "short",
                query(f"sum by (exit) (increase(picker_drains_closed_total[{RATE}]))", "{{exit}}"),
            )
        )
        .with_panel(
            series(
                "How requests on draining endpoints ended",
                "completed is the goal; cut and upstream-error are requests a drain lost.",
                "reqps",
                query(f"sum by (end) (rate(picker_drain_request_ends_total[{RATE}]))", "{{end}}"),
            )
        )
        .with_panel(
            series(
                "Drain time to zero in flight",
                "From a drain's start until its last request ended: compare with the grace period.",
                "s",
                *quantiles("picker_drain_time_to_zero_seconds", "to zero"),
            )
        )
    )
    board = (
        board.with_row(dashboard.Row("Streams"))
        .with_panel(
            series(
                "Truncated streams per endpoint",
                "Streams cut after their first byte: the client got a partial answer.",
                "short",
                query(
                    f"sum by (endpoint) (increase(picker_endpoint_truncations_total[{RATE}]))", "{{endpoint}}"
                ),
            )
        )
        .with_panel(
            series(
                "Stalled streams per endpoint",
                "Streams that went silent longer than the stall limit.",
                "short",
                query(f"sum by (endpoint) (increase(picker_endpoint_stalls_total[{RATE}]))", "{{endpoint}}"),
            )
        )
        .with_panel(
            series(
                "Request ends by reason",
                "Every request's one end reason.",
                "reqps",
                query(f"sum by (reason) (rate(picker_request_ends_total[{RATE}]))", "{{reason}}"),
            )
        )
        .with_panel(
            series(
                "Picks per endpoint",
                "Primary picks per second on each endpoint.",
                "reqps",
                query(f"sum by (endpoint) (rate(picker_picks_total[{RATE}]))", "{{endpoint}}"),
            )
        )
    )
    board = (
        board.with_row(dashboard.Row("Admission queue"))
        .with_panel(
            series(
                "Queue",
                "Requests waiting in the picker for capacity (not on the engines).",
                "short",
                query("picker_flow_queue_size", "queued requests"),
            )
        )
        .with_panel(
            series(
                "Admission outcomes other than dispatched",
                "429 saturated / ttl-expired, 503 shutting-down / no-endpoints, 4xx bad requests.",
                "reqps",
                query(
                    f'sum by (outcome) (rate(picker_requests_total{{outcome!="dispatched"}}[{RATE}]))',
                    "{{outcome}}",
                ),
            )
        )
        .with_panel(
            series(
                "Queue wait",
                "Time spent queued in the picker.",
                "s",
                *quantiles("picker_flow_wait_seconds", "wait"),
            )
        )
    )
    board = (
        board.with_row(dashboard.Row("Latency"))
        .with_panel(
            series(
                "Time to first token",
                "Admission to first response byte, all models.",
                "s",
                *quantiles("picker_time_to_first_token_seconds", "TTFT"),
            )
        )
        .with_panel(
            series(
                "Inter-token latency",
                "Gap between stream chunks, all models.",
                "s",
                *quantiles("picker_inter_token_latency_seconds", "ITL"),
            )
        )
    )
    return board.with_row(dashboard.Row("Model server scrapes")).with_panel(
        series(
            "Scrape failures per endpoint",
            "Failed /metrics reads of the model servers: the picker routes on stale load while they fail.",
            "short",
            query(
                f"sum by (endpoint, kind) (increase(picker_scrape_failures_total[{RATE}]))",
                "{{endpoint}} {{kind}}",
            ),
        )
    )


def render() -> str:
    board = build().build()
    for number, panel in enumerate(board.panels or [], start=1):
        panel.id_val = number  # Grafana links, alerts and "view panel" need unique ids
    return json.dumps(board, cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="exit 1 when the committed JSON is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUTPUT.exists() or OUTPUT.read_text() != text:
            print(f"{OUTPUT} is stale: run {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
