"""API keys of the router (`--api-key-file`), hashed at rest, and `conveyor keys add`.

The key file holds one key per line, never the key itself::

    # comments and blank lines are ignored
    sha256:<64 hex digits> principal=alice tenant=team-a priority_max=0

* `principal`: who the key's requests belong to (their ids live in its namespace);
* `tenant` (default: the principal): the tenant its requests run as, for the `fair` policy
  and the prefix cache (shared within a tenant only); a request naming another tenant is
  refused (PERMISSION_DENIED);
* `priority_max` (default 0): the most urgent priority its requests may have (lower values
  run first); a request asking for a lower value runs at this one.

Keys are random (`cvk_` + 43 URL-safe characters, 256 bits), so one SHA-256 is enough to keep
them unrecoverable from the file. Several keys may share a principal (rotation). The router
reads the file when it starts.

    conveyor keys add --file keys.txt --principal alice --tenant team-a

prints the new key once (it cannot be shown again) and appends its line to the file.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import secrets
import sys
from pathlib import Path

from services.common.auth import PRINCIPAL_PATTERN, CallCredentials, Principal
from services.common.errors import ConfigError, Unauthenticated

KEY_PREFIX = "cvk_"
_LINE = re.compile(r"\Asha256:(?P<digest>[0-9a-f]{64})(?P<attrs>(?:\s+\S+)*)\s*\Z")
_ATTRS = ("principal", "tenant", "priority_max")
_TENANT = re.compile(r"\A[A-Za-z0-9._:@-]{1,64}\Z")


def digest(key: str) -> str:
    """The hex SHA-256 of a key, as the key file stores it."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def format_line(key: str, principal: str, tenant: str | None, priority_max: int) -> str:
    return (
        f"sha256:{digest(key)} principal={principal} tenant={tenant or principal} "
        f"priority_max={priority_max}"
    )


def parse_key_file(text: str, path: str = "--api-key-file") -> dict[str, Principal]:
    """digest -> principal of every key line; ConfigError naming the line otherwise."""
    keys: dict[str, Principal] = {}
    lines: dict[str, int] = {}  # digest -> its line number
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{path} line {number}"
        match = _LINE.match(line)
        if match is None:
            raise ConfigError(
                f"{where} is not `sha256:<64 hex digits> principal=NAME [tenant=T] "
                "[priority_max=N]` (make lines with `conveyor keys add`)"
            )
        attrs = dict(item.partition("=")[::2] for item in match["attrs"].split())
        unknown = sorted(set(attrs) - set(_ATTRS))
        if unknown:
            raise ConfigError(f"{where}: unknown attribute {unknown[0]!r} (known: {_ATTRS})")
        digest_ = match["digest"]
        if digest_ in keys:
            # Which line would win is an editing slip away from moving a key to another
            # principal, tenant or priority: refuse, as for a malformed line.
            raise ConfigError(
                f"{where} repeats the key of line {lines[digest_]}: keep one line per key "
                "(`conveyor keys add` makes a new key)"
            )
        lines[digest_] = number
        keys[digest_] = _principal(attrs, where)
    return keys


def _principal(attrs: dict[str, str], where: str) -> Principal:
    name = attrs.get("principal", "")
    if not PRINCIPAL_PATTERN.match(name):
        raise ConfigError(
            f"{where}: principal={name!r} must be 1 to 64 letters, digits, '.', '_', '@' or '-'"
        )
    tenant = attrs.get("tenant") or name
    if not _TENANT.match(tenant):
        raise ConfigError(f"{where}: tenant={tenant!r} must be 1 to 64 of [A-Za-z0-9._:@-]")
    try:
        priority_max = int(attrs.get("priority_max", "0"))
    except ValueError:
        raise ConfigError(f"{where}: priority_max must be an integer") from None
    return Principal(name, tenant=tenant, priority_max=priority_max)


def load_key_file(path: str) -> dict[str, Principal]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read --api-key-file {path}: {exc.strerror or exc}") from exc
    keys = parse_key_file(text, path)
    if not keys:
        raise ConfigError(f"--api-key-file {path} holds no key: add one with `conveyor keys add`")
    return keys


class ApiKeyAuth:
    """The router with --api-key-file: every call needs `authorization: Bearer <key>`."""

    is_open = False

    def __init__(self, keys: dict[str, Principal]):
        self._keys = keys
        principals = {p.name for p in keys.values()}
        self.description = f"API keys ({len(keys)} keys of {len(principals)} principals)"

    def authenticate(self, call: CallCredentials) -> Principal:
        if call.bearer is None:
            raise Unauthenticated(
                "this router needs an API key: send it as `authorization: Bearer <key>` "
                "(a gRPC metadata entry or an HTTP header; conveyor generate and the Python "
                "client read CONVEYOR_API_KEY, the openai client takes api_key)"
            )
        principal = self._keys.get(digest(call.bearer))
        if principal is None:
            raise Unauthenticated(
                "the API key is not valid here (mistyped, revoked, or made for another deployment)"
            )
        return principal


# -- `conveyor keys` -----------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    add = sub.add_parser(
        "add", help="make a new API key: prints it once and appends its hash to --file"
    )
    add.add_argument("--file", required=True, help="the key file (created when missing)")
    add.add_argument("--principal", required=True, help="whom the key's requests belong to")
    add.add_argument(
        "--tenant", default=None, help="tenant its requests run as (default: the principal)"
    )
    add.add_argument(
        "--priority-max",
        type=int,
        default=0,
        help="most urgent priority its requests may have; lower runs first (default: 0)",
    )


def run(args: argparse.Namespace) -> int:
    key = new_key()
    line = format_line(key, args.principal, args.tenant, args.priority_max)
    parse_key_file(line, "the new line")  # validates principal and tenant
    path = Path(args.file)
    try:
        existing = path.read_text() if path.exists() else ""
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with os.fdopen(fd, "a") as f:
            if existing and not existing.endswith("\n"):
                f.write("\n")
            f.write(line + "\n")
    except OSError as exc:  # e.g. a folder that does not exist: no key was made
        raise ConfigError(f"--file {path}: cannot write the key file ({exc.strerror})") from None
    print(
        f"added a key for principal {args.principal!r} to {path}; it is shown once:",
        file=sys.stderr,
    )
    print(key)
    return 0
