"""What the router sends the scheduler on behalf of a key (against the fake scheduler of
tests/router): the key's principal, tenant and priority ceiling, the internal token on every
call, and one random owner token per Submit that its Resume and Abort carry."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
import pytest

from services.client.client import ConveyorClient
from services.common.certs import write_certs
from services.common.security import ClientSecurity
from tests.router.utils import FakeScheduler, FakeSchedulerServer, RouterProcess, wait_until

TOKEN = "router-to-scheduler-token"


@dataclass
class RecordingScheduler(FakeScheduler):
    """The fake scheduler, also keeping each call's authorization and owner fields."""

    calls: list[tuple[str, str, str, str]] = field(default_factory=list)
    """(method, authorization metadata, principal, owner_token)."""

    def _record(self, method: str, request, context) -> None:
        auth = dict(context.invocation_metadata() or ()).get("authorization", "")
        self.calls.append((method, auth, request.principal, request.owner_token))

    async def Submit(self, request, context):
        self._record("Submit", request, context)
        async for delta in super().Submit(request, context):
            yield delta

    async def Resume(self, request, context):
        self._record("Resume", request, context)
        async for delta in super().Resume(request, context):
            yield delta

    async def Abort(self, request, context):
        self._record("Abort", request, context)
        return await super().Abort(request, context)


@pytest.fixture(scope="module")
def fake_server(tiny_tokenizer_ids):
    server = FakeSchedulerServer(RecordingScheduler(answer_ids=tiny_tokenizer_ids)).start()
    yield server
    server.stop()


@pytest.fixture()
def fake(fake_server):
    fake_server.fake.reset()
    fake_server.fake.calls.clear()
    return fake_server.fake


@pytest.fixture(scope="module")
def tiny_tokenizer_ids(tiny_dir):
    from services.router.tokenizer import Tokenizer

    return Tokenizer.from_dir(tiny_dir).encode("one two three four five six seven eight")


@pytest.fixture(scope="module")
def router(fake_server, tiny_dir, credentials, tmp_path_factory):
    folder = tmp_path_factory.mktemp("router")
    certs = write_certs(folder / "certs")
    (folder / "token").write_text(TOKEN)
    proc = RouterProcess(
        fake_server.address,
        tiny_dir,
        "--api-key-file",
        str(credentials.key_file),
        "--tls-cert",
        str(certs.cert),
        "--tls-key",
        str(certs.key),
        "--internal-token-file",
        str(folder / "token"),
        security=ClientSecurity.from_files(certs.ca),
    )
    proc.ca = certs.ca
    yield proc.wait_serving()
    proc.stop()


def _client(router, credentials, principal: str) -> ConveyorClient:
    return ConveyorClient(
        router.address, timeout_s=30, api_key=credentials.api_keys[principal], tls_ca=str(router.ca)
    )


def test_key_sets_principal_tenant_and_priority_ceiling(fake, router, credentials):
    with _client(router, credentials, "mallory") as mallory:
        mallory.complete("hi", max_tokens=2, priority=0)
        mallory.complete("hi", max_tokens=2, priority=9)
    with _client(router, credentials, "alice") as alice:
        alice.complete("hi", max_tokens=2, priority=-4)
        # Out of range is refused, as without a key (the ceiling ran it at 0 instead).
        with pytest.raises(grpc.RpcError) as refused:
            alice.complete("hi", max_tokens=2, priority=-5000)
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "priority=-5000 is out of range" in refused.value.details()
    got = [(s.tenant, s.priority, s.principal) for s in fake.submits]
    assert got == [("team-m", 5, "mallory"), ("team-m", 9, "mallory"), ("team-a", 0, "alice")]
    tokens = [s.owner_token for s in fake.submits]
    assert all(len(t) == 32 for t in tokens) and len(set(tokens)) == 3
    assert {auth for _, auth, _, _ in fake.calls} == {f"Bearer {TOKEN}"}


def test_resume_and_abort_carry_the_submit_owner_token(fake, router, credentials):
    fake.reset(mode="break", break_after=2)
    with _client(router, credentials, "bob") as bob:
        bob.complete("hi", max_tokens=6)
    (submit,) = [c for c in fake.calls if c[0] == "Submit"]
    resumes = [c for c in fake.calls if c[0] == "Resume"]
    assert resumes and {c[2:] for c in resumes} == {submit[2:]} == {("bob", submit[3])}

    fake.reset(mode="endless")
    fake.calls.clear()
    with _client(router, credentials, "bob") as bob:
        stream = bob.generate("hi", max_tokens=1000, ignore_eos=True)
        next(stream)
        stream.close()  # the client cancels: the router aborts the request it submitted
    wait_until(lambda: any(c[0] == "Abort" for c in fake.calls), what="the abort")
    submit = next(c for c in fake.calls if c[0] == "Submit")
    abort = next(c for c in fake.calls if c[0] == "Abort")
    assert abort[1:] == submit[1:]


def test_refusals_are_unauthenticated_or_permission_denied(fake, router, credentials):
    plain_key = ConveyorClient(router.address, timeout_s=30, tls_ca=str(router.ca))
    with plain_key, pytest.raises(grpc.RpcError) as caught:
        plain_key.complete("hi", max_tokens=2)
    assert caught.value.code() is grpc.StatusCode.UNAUTHENTICATED
    with _client(router, credentials, "bob") as bob, pytest.raises(grpc.RpcError) as caught:
        bob.complete("hi", max_tokens=2, tenant="team-a")
    assert caught.value.code() is grpc.StatusCode.PERMISSION_DENIED
    assert "tenant='team-a' is not yours" in caught.value.details()
    assert fake.submits == []  # neither reached the scheduler
