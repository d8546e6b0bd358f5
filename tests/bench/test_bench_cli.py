"""`conveyor bench` flags: an out-of-range value is a usage error naming the flag (exit 2, no
traceback), and 0 never silently means the default."""

from __future__ import annotations

import pytest

from services.bench.cli import _workload
from services.cli import build_parser


def bench_args(*argv: str):
    return build_parser().parse_args(["bench", *argv])


@pytest.mark.parametrize(
    ("flag", "value", "allowed"),
    [
        ("--num-prompts", "0", ">= 1"),  # ran 64
        ("--num-prompts", "-3", ">= 1"),
        ("--input-len", "0", ">= 1"),  # sent 128-token prompts
        ("--output-len", "0", ">= 1"),  # generated 128 tokens
        ("--range-ratio", "2", "in [0, 1)"),
        ("--range-ratio", "1", "in [0, 1)"),
        ("--range-ratio", "-0.1", "in [0, 1)"),
        ("--request-rate", "-1", "> 0"),
        ("--request-rate", "0", "> 0"),
        ("--request-rate", "nan", "> 0"),
        ("--prefix-len", "0", ">= 1"),
        ("--num-prefixes", "0", ">= 1"),
        ("--max-concurrency", "0", ">= 1"),  # meant no limit
        ("--seed", "-1", ">= 0"),
        ("--timeout", "0", "> 0"),
        ("--rounds", "0", ">= 1"),
        ("--threads-per-worker", "0", ">= 1"),
        ("--max-model-len", "0", ">= 1"),  # meant the model's
    ],
)
def test_bench_refuses_an_out_of_range_flag_as_a_usage_error(capsys, flag, value, allowed):
    with pytest.raises(SystemExit) as exit_info:
        bench_args(flag, value)
    assert exit_info.value.code == 2
    assert f"argument {flag}: {value} is out of range: must be {allowed}" in capsys.readouterr().err


def test_bench_refuses_a_value_that_is_no_number(capsys):
    with pytest.raises(SystemExit):
        bench_args("--num-prompts", "many")
    assert "argument --num-prompts: invalid int value: 'many'" in capsys.readouterr().err


def test_bench_workload_takes_the_flags_or_the_defaults():
    workload = _workload(bench_args())
    assert (workload.num_prompts, workload.input_len, workload.output_len) == (64, 128, 128)
    workload = _workload(bench_args("--num-prompts", "1", "--input-len", "1", "--output-len", "1"))
    assert (workload.num_prompts, workload.input_len, workload.output_len) == (1, 1, 1)


def test_bench_accepts_the_edges_of_each_range():
    args = bench_args("--range-ratio", "0.99", "--request-rate", "inf", "--seed", "0")
    assert (args.range_ratio, args.request_rate, args.seed) == (0.99, float("inf"), 0)
