"""`--redis-url` is checked before a client is made, and never shown with its password."""

from __future__ import annotations

import pytest

from services.common.errors import ConfigError
from services.common.redis_url import check_redis_url, redacted, refused_auth_message


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("htp://nonsense", "the scheme must be redis://, rediss:// or unix://"),
        ("127.0.0.1:6379", "the scheme must be"),
        ("redis://127.0.0.1:notaport/0", "the port must be a number"),
        ("redis://127.0.0.1:99999/0", "the port must be a number"),
        ("redis://127.0.0.1:6379/abc", "the database 'abc' must be a number"),
        ("redis://127.0.0.1:6379/0?db=x", "Invalid value for 'db'"),
    ],
)
def test_check_redis_url_refuses_what_redis_py_misreads(url, message):
    with pytest.raises(ConfigError) as caught:
        check_redis_url(url)
    assert str(caught.value).startswith(f"--redis-url {url}: ")
    assert message in str(caught.value)


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6379/0",
        "redis://localhost",
        "redis://:pw@redis:6379/3",
        "rediss://redis:6380/0?ssl_ca_certs=/etc/redis/ca.pem",
        "unix:///run/redis.sock?db=2",
    ],
)
def test_check_redis_url_accepts_the_documented_forms(url):
    check_redis_url(url)


def test_check_redis_url_never_shows_the_password():
    with pytest.raises(ConfigError) as caught:
        check_redis_url("redis://:s3cret@127.0.0.1:notaport/0")
    assert "s3cret" not in str(caught.value)
    assert "redis://:***@127.0.0.1:notaport/0" in str(caught.value)


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("redis://:s3cret@h:1/0", "redis://:***@h:1/0"),
        ("redis://user:s3cret@h:1/0", "redis://user:***@h:1/0"),
        ("redis://:p@ss@h:1/0", "redis://:***@h:1/0"),
        ("redis://h:1/0", "redis://h:1/0"),
        ("scheduler --redis-url redis://:s3cret@h:1/0 --port 5", "redis://:***@h:1/0 --port 5"),
        ("--scheduler-arg=--redis-url=redis://u:s3cret@h", "--redis-url=redis://u:***@h"),
    ],
)
def test_redacted_hides_every_password(text, shown):
    assert shown in redacted(text)
    assert "s3cret" not in redacted(text) and "ss@" not in redacted(text)


def test_refused_auth_message_names_the_password_variables():
    message = refused_auth_message("redis://:s3cret@h:1/0", Exception("WRONGPASS"))
    assert "redis://:***@h:1/0 refused to authenticate" in message
    assert "CONVEYOR_REDIS_PASSWORD" in message and "s3cret" not in message
