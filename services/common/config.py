"""Helpers shared by the services' config dataclasses and the CLIs built over them."""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from collections.abc import Callable
from pathlib import Path

from services.common.errors import ConfigError

MAX_PORT = 65535


def default_of(config_cls: type, name: str):
    """The default of field `name` of a config dataclass: CLI flags take their default from
    here, so the config and the command line can never disagree."""
    for field in dataclasses.fields(config_cls):
        if field.name == name:
            if field.default is not dataclasses.MISSING:
                return field.default
            if field.default_factory is not dataclasses.MISSING:
                return field.default_factory()
            raise KeyError(f"{config_cls.__name__}.{name} has no default")
    raise KeyError(f"{config_cls.__name__} has no field {name!r}")


def parse_addr(addr: str, name: str = "address") -> tuple[str, int]:
    """`HOST:PORT` → (host, port), with an error naming the flag."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"{name}={addr!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def checked(kind: type, is_allowed: Callable, allowed: str) -> Callable[[str], int | float]:
    """An argparse `type=` that parses `kind` and refuses a value `is_allowed` rejects: a usage
    error (exit 2) such as "argument --num-prompts: 0 is out of range: must be >= 1".

    Args:
        kind: int or float.
        is_allowed: the test of a parsed value (NaN fails every comparison, so is refused).
        allowed: what the message says is allowed, e.g. ">= 1" or "in [0, 1)".
    """

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
        if not is_allowed(value):
            raise argparse.ArgumentTypeError(f"{text} is out of range: must be {allowed}")
        return value

    return parse


def at_least(low: int) -> Callable[[str], int]:
    """An argparse `type=` for an int of at least `low`."""
    return checked(int, lambda n: n >= low, f">= {low}")


port_number = checked(int, lambda p: 1 <= p <= MAX_PORT, f"in [1, {MAX_PORT}]")
"""An argparse `type=` for a TCP port a server listens on."""


def check_output_file(path: str | Path, flag: str) -> None:
    """Refuses (ConfigError naming `flag`) a file this process cannot write, e.g. one in a
    folder that does not exist: checked at start, so that a trace written as the service
    runs or stops is not lost then, with a traceback. Leaves no file that was not there."""
    target = Path(path)
    if not target.parent.is_dir():
        raise ConfigError(f"{flag} {path}: the folder {target.parent} does not exist")
    existed = target.exists()
    try:
        with open(target, "a"):
            pass
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot write this file ({exc.strerror})") from None
    if not existed:
        target.unlink()


def check_output_dir(path: str | Path, flag: str) -> None:
    """Creates folder `path` (and its parents) unless it exists; ConfigError naming `flag`
    when that fails or the folder cannot hold a new file."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"{flag} {path} is a file: name a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as exc:
        raise ConfigError(
            f"{flag} {path}: cannot write files in this folder ({exc.strerror})"
        ) from None
