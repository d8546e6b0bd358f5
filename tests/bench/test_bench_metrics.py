"""Metric computations of `conveyor bench` on synthetic timestamps."""

import pytest

from services.bench.metrics import RequestOutput, summarize


def _output(prompt_len: int, arrivals: list[tuple[float, int]]) -> RequestOutput:
    out = RequestOutput(prompt_len=prompt_len)
    for elapsed, num_tokens in arrivals:
        out.add_tokens(elapsed, num_tokens)
    out.success = True
    return out


def test_request_output_ttft_itl_tpot_from_single_token_messages():
    out = _output(10, [(0.5, 1), (0.6, 1), (0.8, 1), (0.9, 1)])
    assert out.ttft_s == pytest.approx(0.5)
    assert out.itl_s == pytest.approx([0.1, 0.2, 0.1])
    assert out.tpot_s == pytest.approx((0.9 - 0.5) / 3)
    assert out.output_len == 4 and out.latency_s == pytest.approx(0.9)


def test_request_output_message_of_k_tokens_counts_k_gaps():
    # first message: 2 tokens at 0.3 s (TTFT 0.3, one gap of 0 inside the message);
    # then 3 tokens at 0.6 s: three gaps of 0.1 s
    out = _output(4, [(0.3, 2), (0.6, 3)])
    assert out.ttft_s == pytest.approx(0.3)
    assert out.itl_s == pytest.approx([0.0, 0.1, 0.1, 0.1])
    assert out.output_len == 5
    assert out.tpot_s == pytest.approx(0.3 / 4)


def test_request_output_empty_messages_do_not_count():
    out = _output(4, [(0.2, 0), (0.4, 1)])
    assert out.ttft_s == pytest.approx(0.4) and out.output_len == 1 and out.tpot_s is None


def test_summarize_throughputs_and_percentiles():
    outputs = [_output(100, [(0.1 * (i + 1), 1), (0.1 * (i + 1) + 0.05, 9)]) for i in range(100)]
    failed = RequestOutput(prompt_len=100, error="UNAVAILABLE: gone")
    result = summarize([*outputs, failed], duration_s=10.0)
    assert result["completed"] == 100 and result["failed"] == 1
    assert result["total_output_tokens"] == 1000 and result["total_input_tokens"] == 10_000
    assert result["request_throughput"] == pytest.approx(10.0)
    assert result["output_throughput"] == pytest.approx(100.0)
    assert result["total_token_throughput"] == pytest.approx(1100.0)
    # TTFT 100, 200, ..., 10000 ms: mean 5050, median 5050, p99 (linear) 9901
    assert result["mean_ttft_ms"] == pytest.approx(5050.0)
    assert result["median_ttft_ms"] == pytest.approx(5050.0)
    assert result["p99_ttft_ms"] == pytest.approx(9901.0)
    assert result["mean_tpot_ms"] == pytest.approx(50.0 / 9)
    assert result["median_itl_ms"] == pytest.approx(50.0 / 9)
    assert result["mean_e2el_ms"] == pytest.approx(5050.0 + 50.0)


def test_summarize_nothing_completed_gives_zeros_not_errors():
    result = summarize([RequestOutput(prompt_len=3, error="x")], duration_s=1.0)
    assert result["completed"] == 0 and result["failed"] == 1
    assert result["mean_ttft_ms"] == 0.0 and result["p99_itl_ms"] == 0.0


def test_request_output_counted_from_a_later_release():
    # sent at t=10.0, held in the queue until the release at t=10.4; tokens at 0.5 and 0.7 s
    # after the send: 0.1 and 0.3 s after the release
    out = _output(4, [(0.5, 1), (0.7, 2)])
    out.sent_at = 10.0
    out.count_from(10.4)
    assert out.ttft_s == pytest.approx(0.1) and out.latency_s == pytest.approx(0.3)
    assert out.itl_s == pytest.approx([0.1, 0.1]) and out.sent_at == 10.4
    out.count_from(10.1)  # an earlier moment changes nothing
    assert out.ttft_s == pytest.approx(0.1)


def test_release_at_once_needs_a_scheduler_and_a_burst():
    from services.bench.driver import DriverOptions
    from services.bench.run import BenchTarget
    from services.common.errors import ConfigError

    with pytest.raises(ConfigError, match="give --scheduler"):
        BenchTarget("r:1", None, release_at_once=True)
    with pytest.raises(ConfigError, match="--request-rate"):
        BenchTarget("r:1", "s:2", DriverOptions(request_rate=4.0), release_at_once=True)
    with pytest.raises(ConfigError, match="--max-concurrency"):
        BenchTarget("r:1", "s:2", DriverOptions(max_concurrency=4), release_at_once=True)
    BenchTarget("r:1", "s:2", release_at_once=True)  # a burst: fine
