"""Credentials and stacks for the security tests.

Certificates are made in the test (the `cryptography` package, through
services/common/certs.py), API keys with the key-file format of `conveyor keys add`, and
every stack is real processes: stage workers and a scheduler (tests/integration/utils.py's
`ProcessStack`, so they can be killed and restarted) behind a real `conveyor router`.
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from services.client.client import ConveyorClient
from tests.integration.utils import ProcessStack
from tests.router.utils import RouterProcess

# Stacks without credentials use only what existed before authentication did, so that the
# tests of the rows also run (and fail) against the code they were written for.

# principal -> (tenant, priority_max) of the test's API keys
PRINCIPALS = {"alice": ("team-a", 0), "bob": ("team-b", 0), "mallory": ("team-m", 5)}


@dataclass
class Credentials:
    """Everything a secured stack and its clients need, made in a temporary folder."""

    ca: Path
    cert: Path
    key: Path
    token_file: Path
    token: str
    key_file: Path
    api_keys: dict[str, str] = field(default_factory=dict)
    """principal -> its API key."""

    @property
    def internal_args(self) -> list[str]:
        """Flags of a worker or the scheduler: mutual TLS and the internal token."""
        return [
            "--tls-cert",
            str(self.cert),
            "--tls-key",
            str(self.key),
            "--tls-ca",
            str(self.ca),
            "--internal-token-file",
            str(self.token_file),
        ]

    @property
    def router_args(self) -> list[str]:
        """Flags of the router: API keys, TLS on the public port, mutual TLS and the token
        to the scheduler."""
        return [*self.internal_args, "--api-key-file", str(self.key_file)]

    @property
    def internal_client(self):
        """An operator or router: the internal CA, a certificate and the token."""
        from services.common.security import ClientSecurity

        return ClientSecurity.from_files(self.ca, self.cert, self.key, self.token)

    def client(self, principal: str | None, address: str, **kwargs) -> ConveyorClient:
        """A client of the router as `principal` (None: no API key), over TLS."""
        api_key = self.api_keys[principal] if principal else None
        return ConveyorClient(
            address, timeout_s=120, api_key=api_key, tls_ca=str(self.ca), **kwargs
        )


def make_credentials(folder: Path) -> Credentials:
    from services.common.certs import write_certs
    from services.router.api_keys import format_line, new_key

    files = write_certs(folder / "certs")
    token = secrets.token_urlsafe(24)
    token_file = folder / "internal-token"
    token_file.write_text(token + "\n")
    api_keys, lines = {}, ["# made by tests/security/utils.py"]
    for principal, (tenant, priority_max) in PRINCIPALS.items():
        api_keys[principal] = new_key()
        lines.append(format_line(api_keys[principal], principal, tenant, priority_max))
    key_file = folder / "api-keys"
    key_file.write_text("\n".join(lines) + "\n")
    return Credentials(files.ca, files.cert, files.key, token_file, token, key_file, api_keys)


class RouterStack:
    """Stage workers and a scheduler (`ProcessStack`) behind one real router."""

    def __init__(
        self,
        model_dir: Path,
        stages: int,
        credentials: Credentials | None = None,
        max_model_len: int = 2048,
        router_args: tuple[str, ...] = (),
    ):
        creds = credentials
        self.credentials = creds
        pipeline_security, router_security = {}, {}
        if creds:
            from services.common.security import ClientSecurity

            pipeline_security = {"security": creds.internal_client}
            router_security = {"security": ClientSecurity.from_files(creds.ca)}
        self.pipeline = ProcessStack(
            model_dir,
            stages,
            kv_cache_memory="32MiB",
            max_model_len=max_model_len,
            worker_args=creds.internal_args if creds else [],
            scheduler_args=creds.internal_args if creds else [],
            **pipeline_security,
        )
        self.router = RouterProcess(
            self.pipeline.address,
            model_dir,
            *(creds.router_args if creds else []),
            *router_args,
            **router_security,
        )

    @property
    def address(self) -> str:
        return self.router.address

    def start(self) -> RouterStack:
        try:
            self.pipeline.start()
            self.router.wait_serving(120)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        self.router.stop()
        self.pipeline.stop()


@dataclass
class Stream:
    """A generation running in a thread: its deltas as they come, and how it ended."""

    thread: threading.Thread | None = None
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: grpc.RpcError | None = None
    started: threading.Event = field(default_factory=threading.Event)

    def join(self, timeout_s: float = 300) -> Stream:
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "the stream did not end"
        return self


def stream_in_thread(client: ConveyorClient, **kwargs) -> Stream:
    """Starts `client.generate(**kwargs)` in a thread; `started` is set at the first token."""
    stream = Stream()

    def run() -> None:
        try:
            for delta in client.generate(**kwargs):
                stream.token_ids.extend(delta.token_ids)
                if delta.token_ids:
                    stream.started.set()
                stream.finish_reason = delta.finish_reason or stream.finish_reason
        except grpc.RpcError as exc:
            stream.error = exc
        finally:
            stream.started.set()

    stream.thread = threading.Thread(target=run, daemon=True)
    stream.thread.start()
    return stream
