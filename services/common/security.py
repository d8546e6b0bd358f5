"""Credentials on the wire: TLS for servers and channels, the internal token, the flags.

    server side   ServerSecurity: its certificate and key (TLS), the CA whose client
                  certificates it requires (mutual TLS), and the Authenticator of its calls
    client side   ClientSecurity: the CA it trusts (TLS on), its own certificate (mutual
                  TLS) and the bearer credential it sends (an API key or the internal token)

Secrets never come from argv: the internal token is read from `CONVEYOR_INTERNAL_TOKEN`, a
file (`--internal-token-file`, `CONVEYOR_INTERNAL_TOKEN_FILE`); API keys of clients from
`CONVEYOR_API_KEY`. Certificate and key paths may come from flags or `CONVEYOR_TLS_CERT`,
`CONVEYOR_TLS_KEY`, `CONVEYOR_TLS_CA` (what docker-compose.tls.yml sets for every service).
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.common import keepalive
from services.common.auth import (
    Authenticator,
    CallCredentials,
    InternalAuth,
    OpenAccess,
    bearer_of,
)
from services.common.credentials import (
    ENV_INTERNAL_TOKEN,
    ENV_INTERNAL_TOKEN_FILE,
    check_ca_file,
    check_tls_files,
    read_file,
)
from services.common.errors import ConfigError, PermissionDenied

if TYPE_CHECKING:  # grpc is imported where it is used: `conveyor --help` stays fast
    import grpc

logger = logging.getLogger(__name__)

ENV_TLS_CERT = "CONVEYOR_TLS_CERT"
ENV_TLS_KEY = "CONVEYOR_TLS_KEY"
ENV_TLS_CA = "CONVEYOR_TLS_CA"
ENV_API_KEY = "CONVEYOR_API_KEY"


def is_loopback(host: str) -> bool:
    """Whether a bind address is reachable from this machine only."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# -- servers -------------------------------------------------------------------------------
@dataclass(slots=True)
class ServerSecurity:
    """How a server is reached: TLS or not, client certificates or not, who gets in."""

    authenticator: Authenticator = field(default_factory=OpenAccess)
    tls_cert: bytes | None = None
    """PEM certificate chain served on the port; None: plaintext."""
    tls_key: bytes | None = field(default=None, repr=False)
    client_ca: bytes | None = None
    """PEM CA bundle whose client certificates are required (mutual TLS); None: none asked."""

    def __post_init__(self) -> None:
        if self.client_ca is not None and self.tls_cert is None:
            raise ConfigError(
                "client certificates (--tls-ca / --tls-client-ca) need TLS on the port: "
                "give --tls-cert and --tls-key too"
            )

    @classmethod
    def from_files(
        cls,
        authenticator: Authenticator,
        cert: str | None = None,
        key: str | None = None,
        client_ca: str | None = None,
    ) -> ServerSecurity:
        check_tls_files(cert, key)
        if client_ca:
            check_ca_file(client_ca, "the client CA")
        return cls(
            authenticator=authenticator,
            tls_cert=read_file(cert, "--tls-cert") if cert else None,
            tls_key=read_file(key, "--tls-key") if key else None,
            client_ca=read_file(client_ca, "the client CA") if client_ca else None,
        )

    @property
    def is_tls(self) -> bool:
        return self.tls_cert is not None

    def credentials(self) -> grpc.ServerCredentials | None:
        import grpc

        if self.tls_cert is None:
            return None
        return grpc.ssl_server_credentials(
            [(self.tls_key, self.tls_cert)],
            root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None,
        )

    def describe(self) -> str:
        transport = "plaintext (no TLS)"
        if self.is_tls:
            transport = "mutual TLS" if self.client_ca is not None else "TLS"
        return f"{transport}, {self.authenticator.description}"


def internal_server_security(
    cert: str | None, key: str | None, ca: str | None, token: str | None
) -> ServerSecurity:
    """An internal service's port (scheduler, worker): TLS with `cert`, client certificates
    of `ca` required (mutual TLS), the internal `token` required; open without either."""
    if token is None and not ca:
        authenticator = OpenAccess()
    else:
        authenticator = InternalAuth(token, requires_certificate=bool(ca))
    return ServerSecurity.from_files(authenticator, cert, key, client_ca=ca)


def check_internal_tls(cert: str | None, key: str | None, ca: str | None) -> None:
    """An internal service's TLS flags: cert and key together, and --tls-ca only with them
    (mutual TLS: it is both served and presented); each file holds what it should."""
    check_tls_files(cert, key)
    if ca and not cert:
        raise ConfigError(
            "--tls-ca turns on mutual TLS, which needs this service's own certificate: give "
            "--tls-cert and --tls-key too"
        )
    if ca:
        check_ca_file(ca, "--tls-ca")


def call_credentials(context: grpc.aio.ServicerContext) -> CallCredentials:
    """The bearer credential and verified certificate identity of one call."""
    return CallCredentials(
        bearer=bearer_of(context.invocation_metadata()), peer_identity=peer_identity(context)
    )


def peer_identity(context: grpc.aio.ServicerContext) -> str | None:
    """The verified client certificate's common name, else its first subject alternative
    name; None without one (plaintext, or TLS without client certificates)."""
    auth = context.auth_context() or {}
    for key in ("x509_common_name", "x509_subject_alternative_name"):
        values = auth.get(key)
        if values:
            return values[0].decode("utf-8", "replace")
    return None


def require_admin(context: grpc.aio.ServicerContext, authenticator: Authenticator) -> None:
    """Admin calls (Pause, UpdateWeights, ...): there is no admin role apart from the internal
    credentials, which the interceptor has checked already; a service that asks for none
    takes admin calls from this machine only (`conveyor up` on localhost).

    Raises:
        PermissionDenied: an open service called from another machine.
    """
    if not authenticator.is_open or is_loopback_peer(context.peer()):
        return
    raise PermissionDenied(
        "admin calls on a service without an internal token are accepted from this machine "
        "only: give every service the internal token (CONVEYOR_INTERNAL_TOKEN or "
        "--internal-token-file) and send it (docs/security.md)"
    )


def is_loopback_peer(peer: str) -> bool:
    """Whether a grpc peer string ("ipv4:127.0.0.1:5000", "ipv6:[::1]:5000", "unix:...") is
    this machine."""
    kind, _, rest = peer.partition(":")
    if kind == "unix":
        return True
    if kind not in ("ipv4", "ipv6"):
        return False
    host = rest.rsplit(":", 1)[0].strip("[]")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1 on a dual-stack port
    return (mapped or address).is_loopback


# -- clients -------------------------------------------------------------------------------
@dataclass(slots=True)
class ClientSecurity:
    """What a client of a Conveyor service presents. The default: plaintext, no credential."""

    root_certificates: bytes | None = None
    """PEM CA bundle the server's certificate must chain to; TLS is on when set."""
    certificate_chain: bytes | None = None
    """This client's certificate (mutual TLS)."""
    private_key: bytes | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    """Sent as `authorization: Bearer <token>` on every call (an API key, or the internal
    token)."""

    @classmethod
    def from_files(
        cls,
        ca: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        token: str | None = None,
    ) -> ClientSecurity:
        check_tls_files(cert, key)
        if cert and not ca:
            raise ConfigError("a client certificate (--tls-cert) needs --tls-ca: TLS is off")
        if ca:
            check_ca_file(ca, "--tls-ca")
        return cls(
            root_certificates=read_file(ca, "--tls-ca") if ca else None,
            certificate_chain=read_file(cert, "--tls-cert") if cert else None,
            private_key=read_file(key, "--tls-key") if key else None,
            token=token or None,
        )

    @property
    def is_tls(self) -> bool:
        return self.root_certificates is not None

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The call metadata carrying the credential (empty without one)."""
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def with_metadata(
        self, metadata: Sequence[tuple[str, str]] | None
    ) -> tuple[tuple[str, str], ...] | None:
        """`metadata` plus the credential (None when both are empty)."""
        merged = (*self.metadata, *(metadata or ()))
        return merged or None

    def channel(
        self,
        address: str,
        options: Sequence[tuple[str, object]] = (),
        keepalive_s: tuple[float, float] = (keepalive.PING_INTERVAL_S, keepalive.PING_TIMEOUT_S),
    ):
        """A grpc.aio channel to `address`, over TLS when a CA is set, pinging the server
        (`keepalive_s`: interval and timeout, services/common/keepalive.py)."""
        import grpc

        options = [*keepalive.channel_options(*keepalive_s), *options]
        if not self.is_tls:
            return grpc.aio.insecure_channel(address, options=options)
        return grpc.aio.secure_channel(address, self._credentials(), options=options)

    def sync_channel(self, address: str, options: Sequence[tuple[str, object]] = ()):
        """A blocking grpc channel to `address`, over TLS when a CA is set, pinging the
        server."""
        import grpc

        options = [*keepalive.channel_options(), *options]
        if not self.is_tls:
            return grpc.insecure_channel(address, options=options)
        return grpc.secure_channel(address, self._credentials(), options=options)

    def _credentials(self) -> grpc.ChannelCredentials:
        import grpc

        return grpc.ssl_channel_credentials(
            root_certificates=self.root_certificates,
            private_key=self.private_key,
            certificate_chain=self.certificate_chain,
        )


# -- flags ---------------------------------------------------------------------------------
def add_tls_arguments(
    parser: argparse.ArgumentParser, cert_help: str, ca_help: str, environ: Mapping[str, str]
) -> None:
    """--tls-cert, --tls-key, --tls-ca, defaulting to CONVEYOR_TLS_CERT / _KEY / _CA."""
    parser.add_argument(
        "--tls-cert",
        default=environ.get(ENV_TLS_CERT) or None,
        metavar="PEM",
        help=f"{cert_help} (env {ENV_TLS_CERT}; default: no TLS)",
    )
    parser.add_argument(
        "--tls-key",
        default=environ.get(ENV_TLS_KEY) or None,
        metavar="PEM",
        help=f"private key of --tls-cert (env {ENV_TLS_KEY})",
    )
    parser.add_argument(
        "--tls-ca",
        default=environ.get(ENV_TLS_CA) or None,
        metavar="PEM",
        help=f"{ca_help} (env {ENV_TLS_CA})",
    )


def add_internal_token_argument(parser: argparse.ArgumentParser, help_text: str) -> None:
    """--internal-token-file (the token itself is never a flag)."""
    parser.add_argument(
        "--internal-token-file",
        default=None,
        metavar="FILE",
        help=f"{help_text} (or env {ENV_INTERNAL_TOKEN} / {ENV_INTERNAL_TOKEN_FILE}; "
        "default: none)",
    )


def internal_client(
    tls_ca: str | None,
    tls_cert: str | None,
    tls_key: str | None,
    token: str | None,
) -> ClientSecurity:
    """How a service calls the next internal one: its own certificate as the client
    certificate when it has one and trusts a CA, plus the internal token."""
    if not tls_ca:
        return ClientSecurity(token=token)
    return ClientSecurity.from_files(tls_ca, tls_cert, tls_key, token)


def log_security(name: str, address: str, security: ServerSecurity, host: str) -> None:
    """One line saying how the service is protected; a warning when it is open to every
    interface without TLS or authentication."""
    what = security.describe()
    if security.authenticator.is_open and not is_loopback(host):
        logger.warning(
            "%s on %s: %s. Anyone who can reach this port can use it: bind it to 127.0.0.1 "
            "(--host), or turn on credentials (docs/security.md)",
            name,
            address,
            what,
        )
    else:
        logger.info("%s on %s: %s", name, address, what)
