"""`conveyor certs`: development certificates for TLS and mutual TLS between the services.

    conveyor certs --out certs --hosts worker-0,worker-1,scheduler,router

writes, into `certs/`:

    ca.crt, ca.key     a private CA (kept and reused by later runs on the same folder)
    tls.crt, tls.key   one certificate for every service, signed by the CA: server and
                       client use, for localhost, 127.0.0.1, ::1 and every --hosts name

`--name client` writes client.crt / client.key instead (another identity from the same CA,
e.g. for an operator's `conveyor stats`). The common name is the identity mutual TLS gives
the caller. Keys are written readable by their owner only. For production, use certificates
from your own CA or cert-manager (docs/security.md).
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import sys
from dataclasses import dataclass
from pathlib import Path

DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True, slots=True)
class CertFiles:
    """Paths of a certificate set written by `write_certs`."""

    ca: Path
    cert: Path
    key: Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, metavar="DIR", help="folder to write into")
    parser.add_argument(
        "--hosts",
        default="",
        help="extra DNS names or IP addresses the certificate is valid for, comma-separated "
        f"(always: {', '.join(DEFAULT_HOSTS)})",
    )
    parser.add_argument(
        "--name",
        default="tls",
        help="file names NAME.crt / NAME.key, and the certificate's common name "
        "(conveyor-NAME) (default: tls)",
    )
    parser.add_argument("--days", type=int, default=365, help="validity in days (default: 365)")
    parser.add_argument(
        "--force", action="store_true", help="replace NAME.crt / NAME.key if they exist"
    )


def run(args: argparse.Namespace) -> int:
    from services.common.errors import ConfigError

    hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
    if args.days < 1:
        raise ConfigError(f"--days={args.days} must be >= 1")
    files = write_certs(Path(args.out), hosts, args.name, args.days, args.force)
    print(f"CA          {files.ca}", file=sys.stderr)
    print(f"certificate {files.cert}", file=sys.stderr)
    print(f"key         {files.key}", file=sys.stderr)
    print(files.cert.parent)
    return 0


def write_certs(
    out: Path,
    hosts: list[str] | tuple[str, ...] = (),
    name: str = "tls",
    days: int = 365,
    force: bool = False,
) -> CertFiles:
    """A CA in `out` (made once, then reused) and NAME.crt / NAME.key signed by it.

    Raises:
        ConfigError: NAME.crt exists (without `force`), or the folder is not writable.
    """
    from services.common.config import check_output_dir
    from services.common.errors import ConfigError

    check_output_dir(out, "--out")
    files = CertFiles(out / "ca.crt", out / f"{name}.crt", out / f"{name}.key")
    if files.cert.exists() and not force:
        raise ConfigError(f"{files.cert} exists: pass --force to replace it")
    ca_key_path = out / "ca.key"
    if files.ca.exists() and ca_key_path.exists():
        ca_cert, ca_key = _load(files.ca, ca_key_path)
    else:
        ca_key = _new_key()
        ca_cert = _ca_certificate(ca_key, days)
        _write_key(ca_key_path, ca_key)
        files.ca.write_bytes(_pem(ca_cert))
    key = _new_key()
    names = list(dict.fromkeys([*DEFAULT_HOSTS, *hosts]))
    cert = _leaf_certificate(key, f"conveyor-{name}", names, ca_cert, ca_key, days)
    _write_key(files.key, key)
    files.cert.write_bytes(_pem(cert))
    return files


def _new_key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _name(common_name: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Conveyor development"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _ca_certificate(key, days: int):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    now = datetime.datetime.now(datetime.timezone.utc)
    name = _name("Conveyor development CA")
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .sign(key, hashes.SHA256())
    )


def _leaf_certificate(key, common_name: str, hosts: list[str], ca_cert, ca_key, days: int):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID

    now = datetime.datetime.now(datetime.timezone.utc)
    alt_names = []
    for host in hosts:
        try:
            alt_names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            alt_names.append(x509.DNSName(host))
    return (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
        .sign(ca_key, hashes.SHA256())
    )


def _pem(cert) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)


def _write_key(path: Path, key) -> None:
    from cryptography.hazmat.primitives import serialization

    data = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # a file that existed keeps its mode through O_CREAT
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _load(cert_path: Path, key_path: Path):
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    return cert, key
