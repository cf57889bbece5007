from __future__ import annotations

import pytest

from loadtest.client import RequestRecord
from loadtest.stats import (
    SLO,
    inter_token_latencies,
    meets_slo,
    percentile,
    summarize,
    tpot,
)


def record(
    index: int,
    chunk_times: list[float],
    output_tokens: int | None = None,
    e2e: float | None = None,
    prompt_tokens: int | None = 10,
    **kw: object,
) -> RequestRecord:
    """A completed request whose chunks arrived at ``chunk_times`` (seconds after send)."""
    r = RequestRecord(index=index, prompt_len=8, max_tokens=output_tokens or len(chunk_times))
    r.chunk_times_s = list(chunk_times)
    r.ttft_s = chunk_times[0] if chunk_times else None
    r.e2e_s = e2e if e2e is not None else (chunk_times[-1] if chunk_times else 0.0)
    r.output_tokens = output_tokens if output_tokens is not None else len(chunk_times)
    r.output_tokens_source = "usage"
    r.prompt_tokens = prompt_tokens
    r.status_code = 200
    for key, value in kw.items():
        setattr(r, key, value)
    return r


def test_percentile_linear_interpolation() -> None:
    xs = [4.0, 1.0, 3.0, 2.0]  # unsorted on purpose; sorted: 1 2 3 4
    assert percentile(xs, 0) == 1.0
    assert percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == pytest.approx(2.5)  # h = 1.5 -> halfway between 2 and 3
    assert percentile(xs, 90) == pytest.approx(3.7)  # h = 2.7 -> 3 + 0.7 * (4 - 3)
    assert percentile(list(range(1, 101)), 99) == pytest.approx(99.01)  # h = 98.01
    assert percentile([5.0], 99) == 5.0
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_percentile_matches_numpy_default() -> None:
    np = pytest.importorskip("numpy")
    xs = [0.3, 7.1, 2.2, 9.9, 4.4, 4.4, 0.0, 12.5, 3.3]
    for q in (1, 10, 25, 50, 75, 90, 99):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_tpot_definition() -> None:
    # TTFT 0.5 s, 5 tokens, stream ends at 1.3 s: the 4 tokens after the first took 0.8 s.
    r = record(0, [0.5, 0.7, 0.9, 1.1, 1.3])
    assert tpot(r) == pytest.approx(0.2)
    # usage count, not chunk count, is the denominator (a chunk may carry several tokens)
    r2 = record(1, [0.5, 1.3], output_tokens=9, e2e=1.3)
    assert tpot(r2) == pytest.approx(0.1)
    assert tpot(record(2, [0.4])) is None  # one token: undefined
    r3 = record(3, [])
    assert tpot(r3) is None


def test_itl_are_gaps_between_chunks() -> None:
    r = record(0, [0.5, 0.6, 0.9, 1.0])
    assert inter_token_latencies(r) == pytest.approx([0.1, 0.3, 0.1])
    assert inter_token_latencies(record(1, [0.5])) == []


def test_goodput_slo_rules() -> None:
    slo = SLO(ttft_s=1.0, tpot_s=0.1)
    fast = record(0, [0.5, 0.55, 0.6])  # ttft .5, tpot .05
    slow_first = record(1, [1.5, 1.55])  # ttft over
    slow_decode = record(2, [0.5, 0.8, 1.1])  # tpot .3 over
    single = record(3, [0.9])  # no TPOT: passes that SLO
    failed = record(4, [0.1, 0.2], error="HTTP 500: boom")
    assert [meets_slo(r, slo) for r in (fast, slow_first, slow_decode, single, failed)] == [
        True,
        False,
        False,
        True,
        False,
    ]
    assert meets_slo(slow_first, SLO(ttft_s=None, tpot_s=0.1))  # None disables a limit
    assert not meets_slo(fast, SLO(ttft_s=None, tpot_s=None, e2e_s=0.5))


def test_summarize_counts_and_throughput() -> None:
    slo = SLO(ttft_s=1.0, tpot_s=0.1)
    records = [
        record(0, [0.5, 0.55, 0.6], output_tokens=3),  # good
        record(1, [2.0, 2.1, 2.2, 2.3], output_tokens=4),  # misses TTFT
        record(2, [], error="HTTP 503: busy", status_code=503, prompt_tokens=None),
        record(3, [0.2, 0.3], cancelled=True, cancel_reason="client"),  # planned hang-up
        record(4, [0.2], cancelled=True, cancel_reason="time_limit"),
    ]
    s = summarize(records, duration_s=4.0, slo=slo, max_concurrency=3)
    assert (s.num_requests, s.num_completed, s.num_errors, s.num_cancelled) == (5, 2, 1, 2)
    assert s.error_rate == pytest.approx(1 / 5)
    assert s.request_throughput_req_s == pytest.approx(2 / 4.0)
    assert s.total_output_tokens == 7
    assert s.output_throughput_tok_s == pytest.approx(7 / 4.0)
    assert s.total_input_tokens == 20  # usage prompt_tokens of the two completed requests
    assert s.total_token_throughput_tok_s == pytest.approx(27 / 4.0)
    # One good request; the planned hang-up is outside the denominator (4 requests count).
    assert s.goodput_req_s == pytest.approx(1 / 4.0)
    assert s.goodput_fraction == pytest.approx(1 / 4)
    assert s.ttft_p50_s == pytest.approx((0.5 + 2.0) / 2)
    assert s.ttft_max_s == pytest.approx(2.0)
    # TPOTs: (0.6-0.5)/2 = 0.05 and (2.3-2.0)/3 = 0.1
    assert s.tpot_mean_s == pytest.approx(0.075)
    # ITL pools the gaps of completed requests: 0.05, 0.05, 0.1, 0.1, 0.1
    assert s.itl_mean_s == pytest.approx(0.08)
    assert s.itl_p50_s == pytest.approx(0.1)
    assert s.e2e_p50_s == pytest.approx((0.6 + 2.3) / 2)
    assert s.max_concurrency == 3
    assert s.slo_ttft_s == 1.0 and s.slo_tpot_s == 0.1 and s.slo_e2e_s is None


def test_summarize_falls_back_to_estimated_prompt_tokens() -> None:
    s = summarize([record(0, [0.1, 0.2], prompt_tokens=None)], 1.0, SLO())
    assert s.total_input_tokens == 8  # RequestRecord.prompt_len from the workload


def test_summarize_empty_and_all_failed() -> None:
    s = summarize([], duration_s=0.0, slo=SLO())
    assert s.num_requests == 0 and s.error_rate == 0.0 and s.goodput_fraction is None
    assert s.ttft_p50_s is None and s.output_throughput_tok_s == 0.0
    failed = [record(i, [], error="x") for i in range(3)]
    s = summarize(failed, duration_s=2.0, slo=SLO())
    assert s.error_rate == 1.0 and s.goodput_fraction == 0.0 and s.tpot_p99_s is None
