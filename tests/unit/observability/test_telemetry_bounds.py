"""Label values a client or a source controls are bounded in length (and model names in number)."""

from __future__ import annotations

from picker.observability.metrics import MAX_LABEL_CHARS, TRUNCATED_MARK, Metrics, bounded_label
from picker.pool import Pool
from picker.streams import EndReason

MIB = 1024 * 1024


def exposition_size_after(models: list[str], endpoint: str) -> tuple[int, str]:
    pool = Pool()
    pool.apply(ready=["10.0.0.1:8000"])
    metrics = Metrics(pool="default")
    metrics.register_pool(pool)
    for model in models:
        metrics.observe_ttft(model, 0.1)
        metrics.observe_itl(model, 0.01)
        metrics.count_end(EndReason.COMPLETED, endpoint, model=model, tokens=3)
    metrics.count_pick(endpoint, 0.0001)
    metrics.count_stall(endpoint)
    metrics.count_upstream_retry(endpoint, 1)
    metrics.count_end(EndReason.UPSTREAM_TRUNCATED, endpoint)
    metrics.count_scrape_failure(endpoint, "MetricsPageError")
    page = metrics.exposition().decode()
    return len(page), page


def test_a_2_mib_model_name_keeps_metrics_small_and_is_cut_with_a_marker() -> None:
    normal_size, _ = exposition_size_after(["m"], "10.0.0.1:8000")
    huge = "x" * (2 * MIB)
    size, page = exposition_size_after([huge, huge + "y", "m"], "10.0.0.1:8000")
    assert size < normal_size + 64 * 1024, f"/metrics grew from {normal_size} to {size} bytes"
    cut = bounded_label(huge)
    assert len(cut) == MAX_LABEL_CHARS and cut.endswith(TRUNCATED_MARK)
    assert f'model="{cut}"' in page


def test_many_long_names_stay_within_the_model_cap_and_the_length_bound() -> None:
    normal_size, _ = exposition_size_after(["m"], "10.0.0.1:8000")
    names = [f"{i}-" + "z" * (64 * 1024) for i in range(200)]
    size, page = exposition_size_after(names, "e" * MIB)
    # 32 bounded model names in three histograms and a counter, plus bounded endpoint labels; the
    # reference's names (picker/observability/reference/) show two histograms again, the name twice
    # (model_name, target_model_name).
    assert size < normal_size + 32 * (4 + 2 * 2) * 16 * (MAX_LABEL_CHARS + 64)
    assert 'model="other"' in page and "e" * (MAX_LABEL_CHARS + 1) not in page


def test_short_values_are_untouched() -> None:
    assert bounded_label("meta-llama/Llama-3.1-8B-Instruct") == "meta-llama/Llama-3.1-8B-Instruct"
    assert bounded_label("a" * MAX_LABEL_CHARS) == "a" * MAX_LABEL_CHARS
