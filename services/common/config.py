"""Helpers shared by the services' config dataclasses and the CLIs built over them."""

from __future__ import annotations

import dataclasses

from services.common.errors import ConfigError


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
