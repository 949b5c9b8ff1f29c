"""The soak benchmark's pure helpers: /proc parsing, and the growth figures it reports (issue 15)."""

from __future__ import annotations

import math
import os

from loadtest.bench_soak import (
    Sample,
    failed_ends,
    fds_needed,
    growth,
    parse_max_open_files,
    parse_vmrss,
    rss,
    slope_mb_per_10k,
)

STATUS = "Name:\tpython\nVmPeak:\t  300000 kB\nVmHWM:\t  250000 kB\nVmRSS:\t  123456 kB\nThreads:\t4\n"
LIMITS = (
    "Limit                     Soft Limit           Hard Limit           Units     \n"
    "Max cpu time              unlimited            unlimited            seconds   \n"
    "Max open files            20000                65536                files     \n"
)


def test_vmrss_is_the_resident_line_in_bytes_not_the_peak() -> None:
    assert parse_vmrss(STATUS) == 123456 * 1024
    assert parse_vmrss("Name:\tzombie\n") == 0


def test_rss_of_this_process_matches_proc() -> None:
    own = rss(os.getpid())
    assert own > 1_000_000  # a Python process: megabytes, read from /proc/PID/status
    assert rss(2**22 + 12345) == 0  # no such process: 0, not an exception


def test_open_file_limit_is_the_soft_one() -> None:
    assert parse_max_open_files(LIMITS) == 20000
    assert parse_max_open_files(LIMITS.replace("20000 ", "unlimited")) == -1


def test_envoy_needs_two_sockets_per_stream() -> None:
    assert fds_needed(10_000) >= 20_000
    assert fds_needed(10_000) - fds_needed(5_000) == 10_000


def _sample(done: int, rss_mb: float) -> Sample:
    return Sample(elapsed=done / 100, done=done, picker_rss=int(rss_mb * 1e6), envoy_rss=0, in_flight=0)


def test_growth_from_warm_up_to_end_per_10k_requests() -> None:
    grew, per_10k = growth(_sample(10_000, 100.0), _sample(100_000, 118.0))
    assert math.isclose(grew, 18.0)
    assert math.isclose(per_10k, 2.0)
    assert math.isnan(growth(_sample(5, 100.0), _sample(5, 101.0))[1])


def test_slope_sees_a_steady_leak_and_not_a_flat_line() -> None:
    leak = [_sample(d, 100.0 + d / 10_000 * 1.5) for d in range(0, 100_001, 10_000)]
    assert math.isclose(slope_mb_per_10k(leak), 1.5)
    flat = [_sample(d, 100.0 + (0.2 if i % 2 else -0.2)) for i, d in enumerate(range(0, 100_001, 10_000))]
    assert abs(slope_mb_per_10k(flat)) < 0.1
    assert math.isnan(slope_mb_per_10k(leak[:1]))
    assert math.isnan(slope_mb_per_10k([leak[0], leak[0]]))


def test_failed_ends_counts_what_was_not_a_200_by_flags_and_details() -> None:
    lines = [
        '{"code": 200, "flags": "-", "details": "via_upstream"}',
        '{"code": 503, "flags": "UO", "details": "upstream_rq_active_overflow"}',
        '{"code": 503, "flags": "UO", "details": "upstream_rq_active_overflow"}',
        '{"code": 0, "flags": "DC", "details": "downstream_remote_disconnect"}',
        "not json",
    ]
    ends = failed_ends(lines)
    assert ends == {"503 UO upstream_rq_active_overflow": 2, "0 DC downstream_remote_disconnect": 1}
