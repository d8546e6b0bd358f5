"""Secrets and certificate files, read and checked as a service starts: the internal token
(one line of printable ASCII, from a file or the environment, never blank) and PEM
certificates, keys and CAs, checked with Python's ssl before grpc gets them (grpc reports a
bad file only as a port it cannot listen on, or a connection refused). Every failure is a
ConfigError naming the flag or variable and the file.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from pathlib import Path

from services.common.errors import ConfigError

ENV_INTERNAL_TOKEN = "CONVEYOR_INTERNAL_TOKEN"
ENV_INTERNAL_TOKEN_FILE = "CONVEYOR_INTERNAL_TOKEN_FILE"


def read_file(path: str, what: str) -> bytes:
    """The bytes of a certificate, key or secret file; ConfigError naming it if unreadable."""
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror or exc}") from exc


def read_secret(path: str, what: str) -> str:
    """A secret held in a file (surrounding whitespace dropped, so a trailing newline is
    fine); it must not be empty, and must be one line of printable ASCII (check_token)."""
    secret = read_file(path, what).decode("utf-8", "replace").strip()
    if not secret:
        raise ConfigError(f"{what} {path} is empty")
    return check_token(secret, f"{what} {path}")


def check_token(token: str, source: str) -> str:
    """`token`, if it can travel as `authorization: Bearer <token>` metadata: one line of
    printable ASCII. grpc refuses anything else on every call ("Illegal header value"), so
    it is refused here, at start, naming its `source` (a file or a variable)."""
    if not all(" " <= char <= "~" for char in token):
        raise ConfigError(
            f"{source}: the internal token must be one line of printable ASCII (letters, "
            "digits, punctuation; e.g. `openssl rand -hex 32`), without line breaks, tabs "
            "or other characters"
        )
    return token


def internal_token(path: str | None, environ: Mapping[str, str]) -> str | None:
    """The internal token: `path` (--internal-token-file), else CONVEYOR_INTERNAL_TOKEN, else
    the file CONVEYOR_INTERNAL_TOKEN_FILE names; None when none is given.

    Raises:
        ConfigError: both variables are set; CONVEYOR_INTERNAL_TOKEN is set but blank (that
        would turn authentication off, e.g. `$(cat missing-file)`); a token that is not one
        line of printable ASCII; a file that cannot be read or is empty.
    """
    if path:
        return read_secret(path, "--internal-token-file")
    token = environ.get(ENV_INTERNAL_TOKEN)
    token_file = environ.get(ENV_INTERNAL_TOKEN_FILE)
    if token is not None and token_file:
        raise ConfigError(
            f"both {ENV_INTERNAL_TOKEN} and {ENV_INTERNAL_TOKEN_FILE} are set: keep one, so "
            "that it is clear which internal token is used"
        )
    if token is not None:
        if not token.strip():
            raise ConfigError(
                f"{ENV_INTERNAL_TOKEN} is set but blank, which would turn authentication "
                "off: set the token, or unset the variable to run without one"
            )
        return check_token(token.strip(), ENV_INTERNAL_TOKEN)
    if token_file:
        return read_secret(token_file, ENV_INTERNAL_TOKEN_FILE)
    return None


def check_tls_files(cert: str | None, key: str | None, prefix: str = "--tls") -> None:
    """A certificate and its key come together, and load (check_key_pair); ConfigError
    otherwise."""
    if bool(cert) != bool(key):
        raise ConfigError(
            f"{prefix}-cert and {prefix}-key go together: give both (the certificate and its "
            "private key), or neither"
        )
    if cert and key:
        check_key_pair(cert, key, prefix)


def check_key_pair(cert: str, key: str, prefix: str = "--tls") -> None:
    """`cert` holds a PEM certificate and `key` its unencrypted PEM private key. Checked with
    Python's ssl before grpc gets them: grpc reports a bad pair only as a port it cannot
    listen on, or a connection refused.

    Raises:
        ConfigError: naming the file and what is wrong with it.
    """
    check_ca_file(cert, f"{prefix}-cert")
    read_file(key, f"{prefix}-key")  # an unreadable file: say so, not "no usable key"
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key, password=_refuse_encrypted_key(f"{prefix}-key", key))
    except OSError as exc:  # ssl.SSLError is an OSError
        if getattr(exc, "reason", None) == "KEY_VALUES_MISMATCH":
            raise ConfigError(
                f"{prefix}-key {key}: the key does not match the certificate of "
                f"{prefix}-cert {cert}"
            ) from exc
        raise ConfigError(
            f"{prefix}-key {key} holds no usable private key: it must be the PEM private key "
            f"of {prefix}-cert {cert}, unencrypted"
        ) from exc


def check_ca_file(path: str, what: str) -> None:
    """`path` holds at least one PEM certificate (a CA bundle, or a certificate chain).

    Raises:
        ConfigError: the file cannot be read, or holds no certificate (empty, garbage, a key).
    """
    read_file(path, what)  # an unreadable file: say so, not "no certificate"
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=path)
    except OSError as exc:
        raise ConfigError(
            f"{what} {path} holds no certificate: it must hold PEM certificates "
            "(-----BEGIN CERTIFICATE-----)"
        ) from exc


def _refuse_encrypted_key(what: str, path: str):
    """The `password` callback of load_cert_chain: grpc takes no passphrase, and OpenSSL
    would otherwise ask for one on the terminal."""

    def refuse() -> bytes:
        raise ConfigError(f"{what} {path} is encrypted: give the key without a passphrase")

    return refuse
