"""`conveyor up` refuses a bad command line at once, with exit 2 and a message naming the flag:
counts out of range, a --model that is no model directory, two flags naming one port. Nothing
is started (no Redis, no child)."""

from __future__ import annotations

import argparse
import logging

import pytest

from services import cli, launcher
from services.common.errors import ConfigError
from services.models.tiny import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("up-arguments") / "m", num_layers=1)


@pytest.fixture
def nothing_starts(monkeypatch):
    monkeypatch.setattr(launcher, "RedisServer", lambda: pytest.fail("Redis was started"))
    monkeypatch.setattr(launcher.Stack, "spawn", lambda *_, **__: pytest.fail("a child started"))
    monkeypatch.setattr(launcher.signal, "signal", lambda *_: None)  # pytest's stay


def up_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="conveyor up")
    launcher.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(
    ("flag", "value", "allowed"),
    [
        ("--stages", "0", ">= 1"),
        ("--stages", "-1", ">= 1"),
        ("--pipelines", "0", ">= 1"),
        ("--tensor-parallel-size", "0", ">= 1"),
        ("--threads", "0", ">= 1"),
        ("--max-model-len", "0", ">= 1"),
        ("--max-restarts", "-1", ">= 0"),
        ("--startup-timeout", "0", "> 0"),
        ("--hang-timeout", "-1", ">= 0"),
        ("--port", "0", "in [1, 65535]"),
        ("--http-port", "70000", "in [1, 65535]"),
        ("--scheduler-port", "-5", "in [1, 65535]"),
        ("--metrics-port", "0", "in [1, 65535]"),
    ],
)
def test_up_refuses_an_out_of_range_flag_as_a_usage_error(capsys, flag, value, allowed):
    with pytest.raises(SystemExit) as exit_info:
        up_args("--model", "m", flag, value)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and f"{value} is out of range: must be {allowed}" in err


@pytest.mark.usefixtures("nothing_starts", "root_logging")
def test_up_refuses_a_missing_model_directory_at_once(tmp_path, capsys):
    """The worker could not load it, and was restarted --max-restarts times (~45 s)."""
    code = cli.main(["up", "--model", str(tmp_path / "nomodel"), "--stages", "1"])
    assert code == 2
    err = capsys.readouterr().err
    assert f"conveyor up: error: --model {tmp_path / 'nomodel'}: " in err
    assert "config.json does not exist" in err


@pytest.mark.usefixtures("nothing_starts")
def test_up_points_a_known_model_name_at_models_fetch(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no directory of that name here
    with pytest.raises(ConfigError, match="`conveyor models fetch smollm2-135m`"):
        launcher.start_stack(up_args("--model", "smollm2-135m"), launcher.Stack())


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--http-port", "50051"], "port 50051 is named twice, by --port and --http-port"),
        (["--scheduler-port", "50051"], "by --port and --scheduler-port"),
        (
            ["--pipelines", "2", "--scheduler-port", "7999"],
            "port 8000 is named twice, by --http-port and --scheduler-port (ports 7999-8000)",
        ),
        (
            ["--stages", "1", "--metrics-port", "50049"],
            "port 50051 is named twice, by --port and --metrics-port (ports 50049-50052)",
        ),
        (["--metrics-port", "65534"], "--metrics-port (ports 65534-65538) goes past the last"),
    ],
)
@pytest.mark.usefixtures("nothing_starts")
def test_up_refuses_a_port_named_twice_naming_both_flags(model_dir, argv, message):
    args = up_args("--model", str(model_dir), "--port", "50051", "--http-port", "8000", *argv)
    with pytest.raises(ConfigError) as exc_info:
        launcher.start_stack(args, launcher.Stack())
    assert message in str(exc_info.value)


@pytest.mark.usefixtures("nothing_starts", "root_logging")
def test_up_port_clash_exits_2(model_dir, capsys):
    code = cli.main(["up", "--model", str(model_dir), "--port", "50051", "--http-port", "50051"])
    assert code == 2
    assert "by --port and --http-port" in capsys.readouterr().err


def test_up_without_http_leaves_its_port_free_for_others():
    args = up_args("--model", "m", "--no-http", "--port", "8000")
    launcher.check_ports(args)  # --http-port's default, 8000, is not served


def test_up_help_says_metrics_listen_on_every_interface():
    parser = argparse.ArgumentParser(prog="conveyor up")
    launcher.add_arguments(parser)
    (action,) = [a for a in parser._actions if "--metrics-port" in a.option_strings]
    assert "0.0.0.0" in action.help and "--host" in action.help


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--trace-scheduler", "{tmp}/no/t.jsonl"], "--trace-scheduler {tmp}/no/t.jsonl: the"),
        (["--timeline", "{tmp}/no/tl.json"], "--timeline {tmp}/no/tl.json: the folder"),
        (["--timeline", "{tmp}/no/tl", "--pipelines", "2"], "--timeline {tmp}/no/tl.p0: the"),
        (["--record-plans", "/proc/conveyor-nope"], "--record-plans /proc/conveyor-nope: cannot"),
        (["--redis-url", "redis://:s3cret@h:port/0"], "--redis-url redis://:***@h:port/0: the"),
        (["--redis-url", "redis://h:6379/abc"], "the database 'abc' must be a number"),
        (["--sim-profile", "h100"], "--sim-profile needs --device sim"),  # was ignored
    ],
)
@pytest.mark.usefixtures("nothing_starts", "root_logging")
def test_up_refuses_an_unwritable_output_or_bad_redis_url_at_once(
    model_dir, tmp_path, capsys, argv, message
):
    """The scheduler refused them with exit 1 and was restarted 5 times (~64 s), or lost its
    timeline as it stopped; the workers' --record-plans folder raised a traceback."""
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert cli.main(["up", "--model", str(model_dir), "--stages", "1", *argv]) == 2
    err = capsys.readouterr().err
    assert message.replace("{tmp}", str(tmp_path)) in err
    assert "s3cret" not in err and "Traceback" not in err


def test_up_logs_children_argv_without_the_redis_password(monkeypatch, caplog):
    monkeypatch.setattr(launcher, "_popen", lambda argv, env: None)
    argv = ["scheduler", "--redis-url", "redis://:s3cret@127.0.0.1:6379/0", "--port", "5"]
    with caplog.at_level(logging.INFO, logger="services.launcher"):
        launcher.Stack().spawn("scheduler", argv)
    assert "--redis-url redis://:***@127.0.0.1:6379/0 --port 5" in caplog.text
    assert "s3cret" not in caplog.text


@pytest.mark.parametrize(
    ("env", "argv", "message"),
    [
        ({"CONVEYOR_INTERNAL_TOKEN": "  "}, [], "CONVEYOR_INTERNAL_TOKEN is set but blank"),
        ({}, ["--internal-token-file", "{tmp}/missing"], "--internal-token-file"),
    ],
)
@pytest.mark.usefixtures("nothing_starts", "root_logging")
def test_up_refuses_a_blank_or_missing_internal_token_before_starting_redis(
    model_dir, tmp_path, monkeypatch, capsys, env, argv, message
):
    """up started Redis, then each child refused the token (exit 2) and up stopped."""
    monkeypatch.delenv("CONVEYOR_INTERNAL_TOKEN", raising=False)
    monkeypatch.delenv("CONVEYOR_INTERNAL_TOKEN_FILE", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert cli.main(["up", "--model", str(model_dir), "--stages", "1", *argv]) == 2
    assert message in capsys.readouterr().err
