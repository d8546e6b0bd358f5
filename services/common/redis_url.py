"""`--redis-url`: checked before a client is made, and shown without its password.

    redis://[[USER]:PASSWORD@]HOST[:PORT][/DB]    plaintext
    rediss://...                                  TLS (redis-py's options in the query)
    unix://[[USER]:PASSWORD@]/PATH[?db=DB]        a Unix socket

redis-py accepts a database that is not a number and silently uses database 0; a bad
scheme or port raises a bare ValueError. Both are refused here with a ConfigError naming
the flag, so the command exits 2 with one line instead of a traceback.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from services.common.errors import ConfigError
from services.common.redis_auth import PASSWORD_ENV, PASSWORD_FILE_ENV

SCHEMES = ("redis", "rediss", "unix")

# ://USER:PASSWORD@ (USER may be empty); PASSWORD runs to the last @ before the host
_PASSWORD = re.compile(r"(://[^:/@\s]*):[^/\s]*@")


def redacted(text: str) -> str:
    """`text` (a URL, or a line holding URLs) with every URL's password replaced by `***`:
    what goes into logs and error messages."""
    return _PASSWORD.sub(r"\1:***@", text)


def check_redis_url(url: str, flag: str = "--redis-url") -> None:
    """Raises ConfigError naming `flag` when `url` is not a Redis URL redis-py reads as
    written (the message shows the URL without its password)."""
    from redis.connection import parse_url

    shown = redacted(url)
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise ConfigError(
            f"{flag} {shown}: the scheme must be redis://, rediss:// or unix:// "
            "(e.g. redis://127.0.0.1:6379/0)"
        )
    try:
        parts.port  # noqa: B018 - raises ValueError when it is not a number in [0, 65535]
    except ValueError:
        raise ConfigError(f"{flag} {shown}: the port must be a number in [1, 65535]") from None
    db = parts.path.strip("/") if parts.scheme != "unix" else ""
    if db and not db.isdigit():
        raise ConfigError(f"{flag} {shown}: the database {db!r} must be a number, e.g. /0")
    try:
        parse_url(url)
    except ValueError as exc:  # e.g. a query option of the wrong type
        raise ConfigError(f"{flag} {shown}: {exc}") from None


def refused_auth_message(url: str, exc: Exception) -> str:
    """What to say when Redis at `url` refused this client's password (or its lack of one)."""
    return (
        f"Redis at {redacted(url)} refused to authenticate this client ({exc}). Give the "
        f"password Redis requires (its requirepass) in {PASSWORD_ENV} or in a file named by "
        f"{PASSWORD_FILE_ENV}."
    )
