"""The pure pieces of the security work: namespaces and owner tokens, tombstones, bearer
parsing, API key files and `conveyor keys add`, certificates, the signed rendezvous."""

from __future__ import annotations

import datetime
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from services.common.auth import CallCredentials, InternalAuth, Principal, bearer_of, principal_name
from services.common.certs import write_certs
from services.common.errors import ConfigError, InvalidRequest, Unauthenticated
from services.common.sampling import SamplingParams
from services.router.api_keys import ApiKeyAuth, digest, load_key_file, parse_key_file
from services.router.core import apply_principal
from services.router.request import GenerateInput
from services.scheduler.ownership import Tombstones, is_owner, request_key
from services.worker.transport import SignedStore, listen_socket, session_prefix

ROOT = Path(__file__).resolve().parents[2]


# -- ownership -----------------------------------------------------------------------------
def test_request_key_is_the_principal_namespace():
    assert request_key("alice", "x") == "alice/x"
    assert request_key("", "x") == "x"  # a caller without a principal: no namespace
    with pytest.raises(InvalidRequest, match="request_id='alice/x'"):
        request_key("", "alice/x")  # cannot reach into a namespace
    with pytest.raises(InvalidRequest, match="principal"):
        request_key("a}b", "x")


def test_owner_token_comparison():
    assert is_owner("abc", "abc") and not is_owner("abc", "abd")
    assert is_owner(None, "") and not is_owner(None, "abc")


def test_tombstones_match_one_submission_and_expire():
    now = [0.0]
    tombstones = Tombstones(ttl_s=10, max_entries=2, clock=lambda: now[0])
    tombstones.add("a/x", "token-1")
    assert not tombstones.take("a/x", "token-2")  # another submission of the same id
    assert tombstones.take("a/x", "token-1")
    assert not tombstones.take("a/x", "token-1")  # taken once
    tombstones.add("a/y", "t")
    now[0] = 11.0
    assert not tombstones.take("a/y", "t")  # expired
    for name in ("p", "q", "r"):
        tombstones.add(name, "t")
    assert len(tombstones) == 2 and not tombstones.take("p", "t")  # the oldest went


# -- credentials on a call -----------------------------------------------------------------
def test_bearer_parsing():
    assert bearer_of([("authorization", "Bearer abc ")]) == "abc"
    assert bearer_of([("authorization", "bearer abc")]) == "abc"
    assert bearer_of([("other", "x")]) is None and bearer_of(None) is None
    for bad in ("abc", "Basic abc", "Bearer "):
        with pytest.raises(Unauthenticated, match="Bearer"):
            bearer_of([("authorization", bad)])
    # Two credentials: which one counts would be a guess (the first won silently).
    with pytest.raises(Unauthenticated, match="one `authorization`"):
        bearer_of([("authorization", "Bearer a"), ("x", "y"), ("authorization", "Bearer b")])


def test_internal_auth_needs_the_token_and_names_the_certificate():
    auth = InternalAuth("tok", requires_certificate=False)
    with pytest.raises(Unauthenticated, match="internal token"):
        auth.authenticate(CallCredentials())
    with pytest.raises(Unauthenticated, match="not valid"):
        auth.authenticate(CallCredentials(bearer="tok2"))
    assert auth.authenticate(CallCredentials(bearer="tok")).name == "internal"
    mtls = InternalAuth(None, requires_certificate=True)
    assert mtls.authenticate(CallCredentials(peer_identity="conveyor-router")).name == (
        "conveyor-router"
    )
    assert principal_name("CN with spaces/and}more") == "CN_with_spaces_and_more"


# -- API keys ------------------------------------------------------------------------------
def test_key_file_lines_and_their_errors():
    line = f"sha256:{digest('cvk_k')} principal=alice tenant=team-a priority_max=3"
    keys = parse_key_file(f"# comment\n\n{line}  # trailing comment\n")
    assert keys == {digest("cvk_k"): Principal("alice", tenant="team-a", priority_max=3)}
    only_principal = parse_key_file(f"sha256:{digest('k2')} principal=bob")
    assert only_principal[digest("k2")] == Principal("bob", tenant="bob", priority_max=0)
    for bad, match in (
        ("cvk_plaintext_key principal=a", "line 1 is not"),
        (f"sha256:{digest('k')} principal=a colour=red", "unknown attribute 'colour'"),
        (f"sha256:{digest('k')} principal=a/b", "principal='a/b'"),
        (f"sha256:{digest('k')} principal=a priority_max=high", "priority_max"),
        (f"sha256:{digest('k')}", "principal=''"),
        (  # the same key twice: which line wins is an editing slip away from another tenant
            f"sha256:{digest('k')} principal=a\n# x\nsha256:{digest('k')} principal=m tenant=b",
            "line 3 repeats the key of line 1",
        ),
    ):
        with pytest.raises(ConfigError, match=match):
            parse_key_file(bad)


def test_api_key_auth():
    auth = ApiKeyAuth(parse_key_file(f"sha256:{digest('cvk_good')} principal=alice"))
    with pytest.raises(Unauthenticated, match="needs an API key"):
        auth.authenticate(CallCredentials())
    with pytest.raises(Unauthenticated, match="not valid"):
        auth.authenticate(CallCredentials(bearer="cvk_bad"))
    assert auth.authenticate(CallCredentials(bearer="cvk_good")).name == "alice"


def test_key_tenant_and_priority_ceiling_replace_what_the_client_declares():
    def request(**fields) -> GenerateInput:
        return GenerateInput(sampling=SamplingParams(), text="hi", **fields)

    key = Principal("mallory", tenant="team-m", priority_max=5)
    req = request(priority=0)
    apply_principal(req, key)
    assert (req.tenant, req.priority) == ("team-m", 5)
    req = request(priority=9, tenant="team-m")
    apply_principal(req, key)
    assert (req.tenant, req.priority) == ("team-m", 9)
    from services.common.errors import PermissionDenied

    with pytest.raises(PermissionDenied, match="team-m"):
        apply_principal(request(tenant="team-a"), key)
    anonymous = request(priority=-3, tenant="anything")
    apply_principal(anonymous, Principal("anonymous"))  # no keys: as declared
    assert (anonymous.tenant, anonymous.priority) == ("anything", -3)


def test_keys_add_prints_the_key_once_and_stores_only_its_hash(tmp_path):
    path = tmp_path / "keys.txt"
    argv = [sys.executable, "-m", "services.cli", "keys", "add", "--file", str(path)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    keys = []
    for principal in ("alice", "bob"):
        done = subprocess.run(
            [*argv, "--principal", principal, "--tenant", "t", "--priority-max", "2"],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert done.returncode == 0, done.stderr
        keys.append(done.stdout.strip())
    text = path.read_text()
    assert all(key not in text for key in keys)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    loaded = load_key_file(str(path))
    assert [loaded[digest(k)].name for k in keys] == ["alice", "bob"]
    assert loaded[digest(keys[0])] == Principal("alice", tenant="t", priority_max=2)


# -- certificates --------------------------------------------------------------------------
def test_certs_reuse_the_ca_and_refuse_to_overwrite(tmp_path):
    from cryptography import x509

    first = write_certs(tmp_path, hosts=["scheduler", "10.0.0.7"])
    ca = first.ca.read_bytes()
    client = write_certs(tmp_path, name="client")
    assert client.ca.read_bytes() == ca  # one CA for the folder
    assert stat.S_IMODE(first.key.stat().st_mode) == 0o600
    cert = x509.load_pem_x509_certificate(first.cert.read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"localhost", "scheduler"} <= set(names.get_values_for_type(x509.DNSName))
    assert {str(a) for a in names.get_values_for_type(x509.IPAddress)} >= {"127.0.0.1", "10.0.0.7"}
    with pytest.raises(ConfigError, match="--force"):
        write_certs(tmp_path)
    write_certs(tmp_path, force=True)


# -- the rendezvous ------------------------------------------------------------------------
def _store() -> dist.TCPStore:
    return dist.TCPStore(
        "127.0.0.1",
        0,
        1,
        is_master=True,
        timeout=datetime.timedelta(seconds=10),
        wait_for_workers=False,
    )


def test_signed_store_refuses_a_value_written_without_the_token():
    master = _store()
    signed = SignedStore(master, b"token")
    signed.set("rank0", b"10.0.0.1:1234")
    assert signed.get("rank0") == b"10.0.0.1:1234"
    master.set("rank1", b"x" * 40)  # a stranger on the store's port
    with pytest.raises(RuntimeError, match="not signed"):
        signed.get("rank1")
    with pytest.raises(RuntimeError, match="not signed"):
        SignedStore(master, b"other-token").get("rank0")


def test_session_prefix_hides_the_epoch_behind_the_token():
    epoch = 1796048719127972825
    assert session_prefix(epoch, None) == f"pipeline/{epoch}"
    secret = session_prefix(epoch, "token")
    assert str(epoch) not in secret
    assert secret != session_prefix(epoch, "other") and secret != session_prefix(epoch + 1, "token")


def test_rendezvous_listens_on_the_given_host_only():
    sock = listen_socket("127.0.0.1", 0)
    try:
        assert sock.getsockname()[0] == "127.0.0.1"
    finally:
        sock.close()
    assert listen_socket("0.0.0.0", 0) is None


def test_gloo_session_forms_over_the_signed_store():
    master = _store()
    received = {}

    def rank(r: int) -> None:
        store = (
            master
            if r == 0
            else dist.TCPStore(
                "127.0.0.1", master.port, 2, is_master=False, timeout=datetime.timedelta(seconds=10)
            )
        )
        signed = SignedStore(dist.PrefixStore(session_prefix(1, "tok"), store), b"tok")
        group = dist.ProcessGroupGloo(signed, r, 2, datetime.timedelta(seconds=10))
        if r == 0:
            group.send([torch.tensor([7.0])], 1, 0).wait()
        else:
            buf = torch.zeros(1)
            group.recv([buf], 0, 0).wait()
            received["value"] = buf.item()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert received == {"value": 7.0}
