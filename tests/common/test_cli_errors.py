"""A bad path or value on the command line is one line naming the flag and exit 2, never a
traceback (exit 1), and a file a service writes later is checked as it starts."""

from __future__ import annotations

import pytest

from services import cli
from services.common.config import check_output_dir, check_output_file
from services.common.errors import ConfigError

UNWRITABLE = "/proc/conveyor-nope"  # /proc refuses new entries, even to root


pytestmark = pytest.mark.usefixtures("root_logging")


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "afile"
    path.write_text("x")
    return path


def one_line_error(capsys, argv: list[str]) -> str:
    """Runs `conveyor ARGV`, which must exit 2 with one line on stderr; returns that line."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    return err


# -- the helpers ---------------------------------------------------------------------------
def test_check_output_file_names_the_missing_folder_and_leaves_nothing(tmp_path):
    with pytest.raises(ConfigError, match="--timeline .*: the folder .*/no does not exist"):
        check_output_file(str(tmp_path / "no" / "t.json"), "--timeline")
    with pytest.raises(ConfigError, match="--timeline .*: cannot write this file"):
        check_output_file(str(tmp_path), "--timeline")  # a folder
    check_output_file(str(tmp_path / "t.json"), "--timeline")
    assert list(tmp_path.iterdir()) == []  # checked, not created
    (tmp_path / "t.json").write_text("kept")
    check_output_file(str(tmp_path / "t.json"), "--timeline")
    assert (tmp_path / "t.json").read_text() == "kept"


def test_check_output_dir_creates_the_folder_or_says_why_not(tmp_path, a_file):
    check_output_dir(str(tmp_path / "a" / "b"), "--record-plans")
    assert (tmp_path / "a" / "b").is_dir() and list((tmp_path / "a" / "b").iterdir()) == []
    with pytest.raises(ConfigError, match=f"--record-plans {a_file} is a file"):
        check_output_dir(str(a_file), "--record-plans")
    with pytest.raises(ConfigError, match="--record-plans /proc/conveyor-nope: cannot write"):
        check_output_dir(UNWRITABLE, "--record-plans")


# -- conveyor models, keys, certs, stats ---------------------------------------------------
def test_models_fetch_into_a_file_or_an_unwritable_dir_is_one_line(capsys, a_file):
    err = one_line_error(capsys, ["models", "fetch", "--dir", str(a_file), "--no-progress"])
    assert f"--dir {a_file} is a file" in err
    err = one_line_error(capsys, ["models", "fetch", "--dir", UNWRITABLE, "--no-progress"])
    assert f"--dir {UNWRITABLE}: cannot write files" in err


def test_models_make_tiny_unwritable_or_bad_sizes_exit_2(capsys, tmp_path):
    err = one_line_error(capsys, ["models", "make-tiny", f"{UNWRITABLE}/tiny"])
    assert f"{UNWRITABLE}/tiny: cannot write files" in err
    err = one_line_error(capsys, ["models", "make-tiny", str(tmp_path / "t"), "--layers", "0"])
    assert "must all be >= 1" in err


def test_keys_add_into_a_missing_folder_makes_no_key(capsys, tmp_path):
    path = tmp_path / "no" / "keys"
    err = one_line_error(capsys, ["keys", "add", "--file", str(path), "--principal", "alice"])
    assert f"--file {path}: cannot write the key file" in err
    assert capsys.readouterr().out == ""  # no key printed that was not stored


def test_certs_out_a_file_is_one_line(capsys, a_file):
    err = one_line_error(capsys, ["certs", "--out", str(a_file)])
    assert f"--out {a_file} is a file" in err


@pytest.mark.parametrize("value", ["-1", "0"])
def test_stats_watch_not_positive_is_a_usage_error(capsys, value):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["stats", "--server", "127.0.0.1:1", "--watch", value])
    assert exit_info.value.code == 2
    assert f"argument --watch: {value} is out of range: must be > 0" in capsys.readouterr().err


# -- conveyor scheduler and router ---------------------------------------------------------
@pytest.mark.parametrize("flag", ["--trace-scheduler", "--timeline"])
def test_scheduler_refuses_an_unwritable_trace_at_start(capsys, tmp_path, flag):
    path = tmp_path / "no" / "trace"
    argv = ["scheduler", "--workers", "127.0.0.1:1", "--port", "1", flag, str(path)]
    err = one_line_error(capsys, argv)
    assert f"{flag} {path}: the folder {path.parent} does not exist" in err


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("htp://x", "the scheme must be"),
        ("redis://:s3cret@127.0.0.1:notaport/0", "the port must be a number"),
        ("redis://127.0.0.1:6379/abc", "the database 'abc' must be a number"),
    ],
)
def test_scheduler_and_router_refuse_a_malformed_redis_url(capsys, tmp_path, url, message):
    for argv in (
        ["scheduler", "--workers", "127.0.0.1:1", "--port", "1"],
        ["router", "--model", str(tmp_path), "--port", "1"],
    ):
        err = one_line_error(capsys, [*argv, "--redis-url", url])
        assert "--redis-url " in err and message in err and "s3cret" not in err


def test_router_model_without_tokenizer_is_one_line(capsys, tmp_path):
    argv = ["router", "--model", str(tmp_path), "--scheduler", "127.0.0.1:1", "--port", "1"]
    err = one_line_error(capsys, argv)
    assert f"conveyor router: error: --model {tmp_path}: " in err
    assert "tokenizer.json does not exist" in err
