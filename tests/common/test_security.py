"""Loading credentials: the internal token from its file or variables, and the PEM files of
TLS, each refused at start with a ConfigError that names it (not a grpc failure later)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization

from services.common.auth import OpenAccess
from services.common.certs import CertFiles, write_certs
from services.common.credentials import (
    ENV_INTERNAL_TOKEN,
    ENV_INTERNAL_TOKEN_FILE,
    check_ca_file,
    check_key_pair,
    internal_token,
    read_secret,
)
from services.common.errors import ConfigError
from services.common.security import (
    ClientSecurity,
    ServerSecurity,
    check_internal_tls,
    internal_server_security,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> CertFiles:
    return write_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def other(tmp_path_factory) -> CertFiles:
    """A certificate and key of another CA: its key matches no certificate of `certs`."""
    return write_certs(tmp_path_factory.mktemp("other"))


def write(tmp_path: Path, name: str, text: str | bytes) -> str:
    path = tmp_path / name
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return str(path)


# -- the internal token --------------------------------------------------------------------
def test_token_file_drops_a_trailing_newline(tmp_path):
    path = write(tmp_path, "token", "s3cret-token\n")
    assert read_secret(path, "--internal-token-file") == "s3cret-token"
    assert internal_token(path, {}) == "s3cret-token"


@pytest.mark.parametrize("text", ["tok1\ntok2\n", "tok\tab", "tök", "tok\x00"])
def test_token_file_refuses_what_is_not_one_line_of_printable_ascii(tmp_path, text):
    path = write(tmp_path, "token", text)
    with pytest.raises(
        ConfigError, match=rf"--internal-token-file {path}: .*one line of printable"
    ):
        internal_token(path, {})
    with pytest.raises(ConfigError, match=rf"{ENV_INTERNAL_TOKEN_FILE} {path}: .*printable ASCII"):
        internal_token(None, {ENV_INTERNAL_TOKEN_FILE: path})


def test_token_variable_refuses_two_lines():
    with pytest.raises(ConfigError, match=rf"{ENV_INTERNAL_TOKEN}: .*one line of printable"):
        internal_token(None, {ENV_INTERNAL_TOKEN: "tok1\ntok2"})


@pytest.mark.parametrize("value", ["", " ", "\n"])
def test_blank_token_variable_is_refused_not_authentication_off(value):
    with pytest.raises(ConfigError, match=f"{ENV_INTERNAL_TOKEN} is set but blank"):
        internal_token(None, {ENV_INTERNAL_TOKEN: value})


def test_token_variable_and_token_file_variable_are_refused_together(tmp_path):
    path = write(tmp_path, "token", "from-file\n")
    both = {ENV_INTERNAL_TOKEN: "from-env", ENV_INTERNAL_TOKEN_FILE: path}
    with pytest.raises(ConfigError, match="both CONVEYOR_INTERNAL_TOKEN and"):
        internal_token(None, both)
    flag = write(tmp_path, "flag-token", "from-flag")
    assert internal_token(flag, both) == "from-flag"  # the flag is explicit: it wins


def test_token_sources_one_at_a_time(tmp_path):
    path = write(tmp_path, "token", "from-file\n")
    assert internal_token(None, {}) is None
    assert internal_token(None, {ENV_INTERNAL_TOKEN: " from-env "}) == "from-env"
    assert internal_token(None, {ENV_INTERNAL_TOKEN_FILE: path}) == "from-file"


# -- TLS files -----------------------------------------------------------------------------
def test_matching_certificate_and_key_pass(certs):
    check_key_pair(str(certs.cert), str(certs.key))
    check_ca_file(str(certs.ca), "--tls-ca")
    check_internal_tls(str(certs.cert), str(certs.key), str(certs.ca))


def test_a_key_of_another_certificate_is_named_a_mismatch(certs, other):
    with pytest.raises(ConfigError, match=r"--tls-key .*: the key does not match the certificate"):
        check_key_pair(str(certs.cert), str(other.key))
    with pytest.raises(ConfigError, match="the key does not match the certificate"):
        internal_server_security(str(certs.cert), str(other.key), None, None)


def test_garbage_key_or_certificate_names_the_file(tmp_path, certs):
    garbage = write(tmp_path, "garbage.pem", "not a pem\n")
    with pytest.raises(ConfigError, match=f"--tls-key {garbage} holds no usable private key"):
        check_key_pair(str(certs.cert), garbage)
    with pytest.raises(ConfigError, match=f"--tls-cert {garbage} holds no certificate"):
        check_key_pair(garbage, str(certs.key))
    with pytest.raises(ConfigError, match=f"--tls-cert {certs.key} holds no certificate"):
        check_key_pair(str(certs.key), str(certs.key))  # the key given for both


def test_unreadable_key_is_named_unreadable(tmp_path, certs):
    missing = str(tmp_path / "missing.key")
    with pytest.raises(ConfigError, match=f"cannot read --tls-key {missing}"):
        check_key_pair(str(certs.cert), missing)


def test_encrypted_key_is_refused_without_a_prompt(tmp_path, certs):
    key = serialization.load_pem_private_key(certs.key.read_bytes(), None)
    encrypted = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"passphrase"),
    )
    path = write(tmp_path, "encrypted.key", encrypted)
    with pytest.raises(ConfigError, match=f"--tls-key {path} is encrypted"):
        check_key_pair(str(certs.cert), path)


@pytest.mark.parametrize("text", ["", "not a pem\n"])
def test_empty_or_garbage_ca_holds_no_certificate(tmp_path, certs, text):
    ca = write(tmp_path, "ca.pem", text)
    with pytest.raises(ConfigError, match=f"--tls-ca {ca} holds no certificate"):
        check_internal_tls(str(certs.cert), str(certs.key), ca)
    with pytest.raises(ConfigError, match=f"the client CA {ca} holds no certificate"):
        ServerSecurity.from_files(OpenAccess(), str(certs.cert), str(certs.key), client_ca=ca)
    with pytest.raises(ConfigError, match=f"--tls-ca {ca} holds no certificate"):
        ClientSecurity.from_files(ca)


def test_client_certificate_and_key_are_checked(certs, other):
    with pytest.raises(ConfigError, match="the key does not match the certificate"):
        ClientSecurity.from_files(str(certs.ca), str(certs.cert), str(other.key))
    security = ClientSecurity.from_files(str(certs.ca), str(certs.cert), str(certs.key), "tok")
    assert security.is_tls and security.token == "tok"


@pytest.mark.parametrize(
    "command", [["health", "127.0.0.1:1"], ["stats", "--server", "127.0.0.1:1"]]
)
def test_client_commands_exit_2_naming_a_bad_ca_file(tmp_path, command):
    """A misconfigured probe must not read as a dead service (health's exit 1)."""
    garbage = write(tmp_path, "garbage.pem", "not a pem\n")
    argv = [sys.executable, "-m", "services.cli", *command, "--tls-ca", garbage]
    env = {name: value for name, value in os.environ.items() if not name.startswith("CONVEYOR_")}
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1
    assert f"--tls-ca {garbage} holds no certificate" in done.stderr
