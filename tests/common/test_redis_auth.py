"""`redis_connection_kwargs`: where the Redis password comes from (environment or a file)."""

from __future__ import annotations

import pytest

from services.common.errors import ConfigError
from services.common.redis_auth import (
    PASSWORD_ENV,
    PASSWORD_FILE_ENV,
    redis_connection_kwargs,
)


def test_redis_auth_no_password_gives_no_kwargs():
    assert redis_connection_kwargs({}) == {}
    assert redis_connection_kwargs({PASSWORD_ENV: "", PASSWORD_FILE_ENV: ""}) == {}


def test_redis_auth_password_from_the_environment():
    assert redis_connection_kwargs({PASSWORD_ENV: "s3cret word"}) == {"password": "s3cret word"}


def test_redis_auth_password_from_a_mounted_file(tmp_path):
    # `echo pw > file` and `kubectl create secret --from-file` leave a trailing newline
    for content in ("from-file", "from-file\n", "from-file\r\n"):
        secret = tmp_path / "redis-password"
        secret.write_text(content)
        kwargs = redis_connection_kwargs({PASSWORD_FILE_ENV: str(secret)})
        assert kwargs == {"password": "from-file"}, repr(content)


def test_redis_auth_keeps_inner_whitespace_of_a_file(tmp_path):
    secret = tmp_path / "redis-password"
    secret.write_text(" two\nlines \n")
    assert redis_connection_kwargs({PASSWORD_FILE_ENV: str(secret)}) == {"password": " two\nlines "}


def test_redis_auth_both_variables_is_an_error(tmp_path):
    secret = tmp_path / "redis-password"
    secret.write_text("a")
    with pytest.raises(ConfigError, match=f"both {PASSWORD_ENV} and {PASSWORD_FILE_ENV}"):
        redis_connection_kwargs({PASSWORD_ENV: "b", PASSWORD_FILE_ENV: str(secret)})


def test_redis_auth_unreadable_or_empty_file_is_an_error(tmp_path):
    missing = tmp_path / "missing"
    with pytest.raises(ConfigError, match=f"{PASSWORD_FILE_ENV}={missing}: cannot read"):
        redis_connection_kwargs({PASSWORD_FILE_ENV: str(missing)})
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        redis_connection_kwargs({PASSWORD_FILE_ENV: str(empty)})
