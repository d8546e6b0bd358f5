"""The Redis password, taken where docker-compose.yml and the Helm chart put it.

    CONVEYOR_REDIS_PASSWORD       the password itself (compose `environment:`, or a Kubernetes
                                  `secretKeyRef` env var)
    CONVEYOR_REDIS_PASSWORD_FILE  a file holding it (a Kubernetes Secret or a Docker secret
                                  mounted as a file); one trailing newline is dropped

Never a flag: argv shows in `ps` and in the manifests. A password inside the URL
(`redis://:PASSWORD@host:6379/0`) keeps working and wins over both (redis-py lets the URL's
parts override keyword arguments); `rediss://` URLs speak TLS and take redis-py's TLS options
in their query (`rediss://host:6380/0?ssl_ca_certs=/etc/redis/ca.pem`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from services.common.errors import ConfigError

PASSWORD_ENV = "CONVEYOR_REDIS_PASSWORD"
PASSWORD_FILE_ENV = "CONVEYOR_REDIS_PASSWORD_FILE"


def redis_connection_kwargs(environ: Mapping[str, str]) -> dict[str, str]:
    """Keyword arguments for `redis.Redis.from_url` that carry the password, if one is set.

    Args:
        environ: the process environment (`os.environ`), passed in so nothing is read at import.

    Returns:
        `{"password": ...}`, or `{}` when neither variable is set (or both are empty).

    Raises:
        ConfigError: both variables are set, or the file cannot be read or is empty.
    """
    password = environ.get(PASSWORD_ENV, "")
    path = environ.get(PASSWORD_FILE_ENV, "")
    if password and path:
        raise ConfigError(
            f"both {PASSWORD_ENV} and {PASSWORD_FILE_ENV} are set: keep one, so that it is "
            "clear which Redis password is used"
        )
    if path:
        try:
            password = Path(path).read_text().removesuffix("\n").removesuffix("\r")
        except OSError as exc:
            raise ConfigError(
                f"{PASSWORD_FILE_ENV}={path}: cannot read the Redis password ({exc.strerror})"
            ) from exc
        if not password:
            raise ConfigError(f"{PASSWORD_FILE_ENV}={path}: the file is empty")
    return {"password": password} if password else {}
