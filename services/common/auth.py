"""Who is calling: principals, the authenticators that find them, and the current one.

Every service's interceptor (services/common/serving.py) asks the service's `Authenticator`
for the principal of each call before the servicer runs, and sets `current_principal`, which
the servicers read (each RPC runs in a task of its own, so the value is the call's own):

    router             ApiKeyAuth (services/router/api_keys.py, --api-key-file):
                       `authorization: Bearer <key>` -> the key's principal, tenant and
                       priority ceiling; CertificateAuth (--tls-client-ca): the client
                       certificate's identity; OpenAccess: "anonymous"
    scheduler, worker  InternalAuth: the shared internal token (`authorization: Bearer`)
                       and/or a client certificate signed by --tls-ca; OpenAccess without
                       either (`conveyor up` on localhost)

grpc.health.v1 is never authenticated (probes) and tells nothing but SERVING or not.
Pure: no grpc here (services/common/security.py reads the credentials off the call).
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Iterable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Protocol

from services.common.errors import Unauthenticated

ANONYMOUS = "anonymous"
"""The principal of every caller when the service asks for no credential."""
INTERNAL = "internal"
"""The principal of a caller that presented the internal token without a certificate."""
PRINCIPAL_PATTERN = re.compile(r"\A[A-Za-z0-9._@-]{1,64}\Z")
"""What a principal name may be: it prefixes request ids in the scheduler ("<principal>/<id>"),
so no "/" (the separator) and nothing that would break a Redis hash tag."""


@dataclass(frozen=True, slots=True)
class Principal:
    """A caller, as its credential says."""

    name: str
    tenant: str | None = None
    """The tenant every request of this principal runs as; None: the request's own field
    (no API keys: tenant is self-declared, as before authentication existed)."""
    priority_max: int | None = None
    """The most urgent priority its requests may have (lower values run first): a request
    asking for a lower value runs at this one. None: any priority."""


ANONYMOUS_PRINCIPAL = Principal(ANONYMOUS)

current_principal: ContextVar[Principal] = ContextVar(
    "conveyor_principal", default=ANONYMOUS_PRINCIPAL
)
"""The principal of the call being served (set by the interceptor before the servicer runs)."""


@dataclass(frozen=True, slots=True)
class CallCredentials:
    """What one call brought."""

    bearer: str | None = None
    """The value after `Bearer ` in the call's `authorization` metadata."""
    peer_identity: str | None = None
    """The verified client certificate's identity (common name, else first SAN); None
    without mutual TLS."""


class Authenticator(Protocol):
    """Finds the principal of a call, or raises `Unauthenticated` saying what to send."""

    description: str
    """How callers are authenticated, for the service's start-up log line."""

    @property
    def is_open(self) -> bool:
        """True when any caller gets in (no credential is asked for)."""

    def authenticate(self, call: CallCredentials) -> Principal: ...


def principal_name(identity: str) -> str:
    """A certificate identity as a principal name: characters a principal may not hold
    become "_", cut at 64 (certificates are issued by the deployment's own CA)."""
    return re.sub(r"[^A-Za-z0-9._@-]", "_", identity)[:64] or ANONYMOUS


def bearer_of(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The token of an `authorization: Bearer <token>` entry; None when there is none.

    Raises:
        Unauthenticated: an `authorization` entry that is not `Bearer <token>`, or more than
        one (which credential counts would be a guess).
    """
    found = None
    for key, value in metadata or ():
        if key != "authorization":
            continue
        if found is not None:
            raise Unauthenticated("send one `authorization` metadata entry, not several")
        text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
        scheme, _, token = text.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthenticated(
                "the authorization metadata must be `Bearer <credential>` (an API key, or "
                "the internal token for internal services)"
            )
        found = token.strip()
    return found


class OpenAccess:
    """Asks for nothing: every caller is "anonymous", or its certificate's identity."""

    description = "unauthenticated: every caller is anonymous"
    is_open = True

    def authenticate(self, call: CallCredentials) -> Principal:
        if call.peer_identity:
            return Principal(principal_name(call.peer_identity))
        return ANONYMOUS_PRINCIPAL


class InternalAuth:
    """Internal services (scheduler, workers): only routers, the scheduler and operators get
    in, with the shared internal token and/or a client certificate of the internal CA (the
    TLS handshake has checked the certificate before a call gets here)."""

    is_open = False

    def __init__(self, token: str | None, requires_certificate: bool):
        if token is None and not requires_certificate:
            raise ValueError("InternalAuth needs a token or client certificates: use OpenAccess")
        self._token = token.encode() if token is not None else None
        self.requires_certificate = requires_certificate
        asked = [
            *(["the internal token"] if token is not None else []),
            *(["a client certificate of the internal CA"] if requires_certificate else []),
        ]
        self.description = "internal callers only: " + " and ".join(asked)

    def authenticate(self, call: CallCredentials) -> Principal:
        if self.requires_certificate and not call.peer_identity:
            raise Unauthenticated(
                "this internal service needs a client certificate signed by its CA (--tls-ca)"
            )
        if self._token is not None:
            if call.bearer is None:
                raise Unauthenticated(
                    "this is an internal Conveyor service: send the internal token as "
                    "`authorization: Bearer <token>` metadata (the CONVEYOR_INTERNAL_TOKEN "
                    "environment variable, or --internal-token-file, of Conveyor's commands)"
                )
            if not hmac.compare_digest(call.bearer.encode(), self._token):
                raise Unauthenticated(
                    "the internal token is not valid: every service of a deployment must be "
                    "given the same one"
                )
        if call.peer_identity:
            return Principal(principal_name(call.peer_identity))
        return Principal(INTERNAL)


class CertificateAuth:
    """The router with --tls-client-ca and no API keys: the client certificate's identity is
    the principal and its tenant; priorities no more urgent than the default (0)."""

    description = "client certificates: the certificate's identity is the principal"
    is_open = False

    def authenticate(self, call: CallCredentials) -> Principal:
        if not call.peer_identity:
            raise Unauthenticated("this router needs a client certificate signed by its CA")
        name = principal_name(call.peer_identity)
        return Principal(name, tenant=name, priority_max=0)
