"""`conveyor generate` answers a sampling flag the router would refuse as docs/api.md says,
`error: INVALID_ARGUMENT: message` and exit 2, without sending it (some do not even fit the
request's fields); values the router accepts pass."""

from __future__ import annotations

import pytest

from services.cli import build_parser
from services.client.cli import check_sampling
from services.client.client import build_request
from services.common.sampling import MAX_SEED, MAX_TOP_K, MAX_UINT32

NO_ROUTER = "127.0.0.1:1"  # never reached: the flags are refused first


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--max-tokens", "-1", "max_tokens=-1 is out of range: must be in [1, 4294967295]"),
        ("--max-tokens", "0", "max_tokens=0 is out of range"),  # on the wire 0 means 16
        ("--max-tokens", "5000000000", "max_tokens=5000000000 is out of range"),
        ("--seed", "-1", "seed=-1 is out of range: must be in [0, 18446744073709551615]"),
        ("--top-k", "3000000000", "top_k=3000000000 is out of range"),
        ("--top-p", "0", "top_p=0.0 is out of range"),  # on the wire 0 means 1
        ("--temperature", "-0.5", "temperature=-0.5 is out of range"),
    ],
)
def test_generate_refuses_an_out_of_range_flag_as_the_router_would(capsys, flag, value, message):
    args = build_parser().parse_args(
        ["generate", "--server", NO_ROUTER, "--prompt", "hi", flag, value]
    )
    code = args._module.run(args)
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: INVALID_ARGUMENT: ") and message in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": MAX_UINT32, "top_k": MAX_TOP_K, "seed": MAX_SEED, "top_p": 1.0},
        {"max_tokens": 1, "top_k": -1, "seed": 0, "temperature": 0.0},  # -1: vLLM's "off"
    ],
)
def test_generate_sends_the_limits_the_router_accepts(kwargs):
    check_sampling(kwargs)
    assert build_request(prompt="hi", **kwargs).sampling.max_tokens == kwargs["max_tokens"]
