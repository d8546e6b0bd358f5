"""Helpers shared by the services' config dataclasses and the CLIs built over them."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

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
