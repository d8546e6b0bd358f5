"""`conveyor bench --compare --speculative-config JSON --peers vllm-ngram`: vLLM without and
with its n-gram speculation beside Conveyor's (the flags, vLLM's command line and config,
its metrics and errors read back, the table; the real vLLM runs behind the bench itself)."""

import argparse
import json
from pathlib import Path

import pytest

from services.bench import cli
from services.bench.peers import vllm, vllm_spec
from services.bench.peers.venv import PeerVenv
from services.bench.spec_compare import PLAIN, SPEC, all_ratios, parse_spec_peers, spec_table

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'

# The lines of a vLLM 0.32 `/metrics` reply that the bench reads (labels as vLLM writes them;
# the per-position counter shares the accepted tokens' prefix and must not be counted).
METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="/m"} 100.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="/m"} 400.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="/m"} 300.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/m",position="0"} 90.0
vllm:generation_tokens_total{engine="0",model_name="/m"} 4096.0
"""


def _args(*argv):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_vllm_ngram_goes_with_the_speculative_comparison_only():
    with pytest.raises(SystemExit, match="vllm-ngram goes with --compare --speculative-config"):
        cli._check_peer_flags(_args("--compare", "--peers", "vllm-ngram"))
    with pytest.raises(SystemExit, match="only vllm-ngram"):
        cli._check_peer_flags(
            _args("--compare", "--speculative-config", NGRAM, "--peers", "vllm,openvino")
        )
    with pytest.raises(SystemExit, match="--rounds"):
        cli._check_peer_flags(
            _args(
                "--compare", "--speculative-config", NGRAM, "--peers", "vllm-ngram", "--rounds", "2"
            )
        )
    cli._check_peer_flags(
        _args(
            "--compare",
            "--dataset",
            "repeat",
            "--speculative-config",
            NGRAM,
            "--peers",
            "vllm-ngram",
            "--dtype",
            "bfloat16",
        )
    )
    assert parse_spec_peers(None) == () and parse_spec_peers("vllm-ngram") == ("vllm-ngram",)


def test_vllm_gets_conveyors_config_with_conveyors_defaults_and_without_its_own_keys():
    config = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5, '
    config += '"prompt_lookup_min": 2, "probe_interval": 8}'
    assert vllm_spec.vllm_speculative_config(config) == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 5,
        "prompt_lookup_min": 2,
    }
    # vLLM would take prompt_lookup_min = prompt_lookup_max here; Conveyor looks down to 1
    assert vllm_spec.vllm_speculative_config(NGRAM) == {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 1,
    }
    with pytest.raises(ValueError, match="draft model"):
        vllm_spec.vllm_speculative_config('{"model": "/m"}')


def test_vllm_serve_with_the_speculative_config(tmp_path):
    venv = PeerVenv.for_spec(vllm.SPEC, tmp_path / "peers", environ={})
    run = vllm.VllmRun(venv, Path("/models/m"), "float32", "0-1", 1, tmp_path)
    config = vllm_spec.vllm_speculative_config(NGRAM)
    argv = vllm.serve_argv(run, 8123, config)
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == config
    assert "--speculative-config" not in vllm.serve_argv(run, 8123)


def test_acceptance_from_vllms_counters_around_the_run():
    after = vllm_spec.spec_counters(METRICS)
    assert after == {"drafts": 100.0, "draft_tokens": 400.0, "accepted_tokens": 300.0}
    before = {"drafts": 20.0, "draft_tokens": 80.0, "accepted_tokens": 40.0}
    got = vllm_spec.acceptance(before, after)
    assert got["spec_acceptance_rate"] == pytest.approx(260 / 320)
    assert got["spec_mean_accepted_length"] == pytest.approx(1 + 260 / 80)
    assert vllm_spec.acceptance({}, {}) == {}  # no speculation: no acceptance figures
    assert vllm_spec.spec_counters("vllm:generation_tokens_total 5.0\n") == {}


def test_a_server_that_did_not_start_reports_vllms_error_line():
    message = (
        "vllm serve exited (1); the end of /r/vllm-serve-spec.log:\n"
        "INFO 11-30 23:40:01 [api_server.py:1] vLLM API server version 0.32.0+cpu\n"
        "Traceback (most recent call last):\n"
        '  File "/v/vllm/config/speculative.py", line 300, in __post_init__\n'
        "ValueError: ngram speculative decoding is not supported on CPU.\n"
        "\n"
    )
    assert vllm_spec.startup_error(message) == (
        "ValueError: ngram speculative decoding is not supported on CPU."
    )
    assert vllm_spec.startup_error("killed\n") == "killed"


def _res(tput, tpot, single, rate=None, length=None):
    res = {"output_throughput": tput, "mean_ttft_ms": 900.0, "mean_tpot_ms": tpot}
    res["single_request_tpot_ms"] = single
    if rate is not None:
        res |= {"spec_acceptance_rate": rate, "spec_mean_accepted_length": length}
    return res


def test_table_and_ratios_with_both_vllm_rows():
    modes = {
        PLAIN.key: _res(200.0, 100.0, 30.0),
        SPEC.key: _res(400.0, 50.0, 12.0, 0.9, 4.6),
        vllm_spec.KEY: _res(250.0, 90.0, 34.0),
        vllm_spec.NGRAM_KEY: _res(500.0, 40.0, 10.0, 0.8, 4.2),
    }
    ratios = all_ratios(modes)
    assert ratios["tpot_ratio"] == 0.5 and ratios["throughput_ratio"] == 2.0
    assert ratios["vllm_tpot_ratio"] == pytest.approx(40 / 90)
    assert ratios["conveyor_spec_over_vllm_ngram_tpot"] == pytest.approx(50 / 40)
    assert ratios["conveyor_spec_over_vllm_ngram_throughput"] == pytest.approx(0.8)
    lines = {line.split("  ")[0]: line for line in spec_table(modes).splitlines()}
    assert "90%" in lines["2 stages async + speculation"]
    assert "4.20" in lines["vLLM CPU + n-gram speculation"]
    assert lines["vLLM CPU, vllm serve"].rstrip().endswith("-")  # no acceptance without


def test_a_vllm_row_that_did_not_start_says_why_and_leaves_the_ratios_out():
    modes = {
        PLAIN.key: _res(200.0, 100.0, 30.0),
        SPEC.key: _res(400.0, 50.0, 12.0, 0.9, 4.6),
        vllm_spec.KEY: _res(250.0, 90.0, 34.0),
        vllm_spec.NGRAM_KEY: {"startup_error": "ValueError: not on CPU", "log": "/r/x.log"},
    }
    ratios = all_ratios(modes)
    assert set(ratios) == {"tpot_ratio", "single_request_tpot_ratio", "throughput_ratio"}
    table = spec_table(modes)
    assert "vLLM CPU + n-gram speculation" in table
    assert "did not start: ValueError: not on CPU" in table
