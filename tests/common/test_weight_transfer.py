"""The trainer → stages weight protocol over a real gloo group (two ranks, two threads)."""

from __future__ import annotations

import threading

import pytest
import torch

from services.common.auth import InternalAuth, OpenAccess
from services.common.errors import PermissionDenied
from services.common.redis_server import free_port
from services.common.security import is_loopback_peer, require_admin
from services.common.weight_transfer import (
    TransferError,
    broadcast_state_dict,
    decode_manifest,
    join_group,
    receive_state_dict,
)


def test_weight_transfer_stage_keeps_only_what_it_owns():
    port, received, errors = free_port(), {}, []
    sent = {
        "model.layers.0.w": torch.randn(4, 3),
        "model.layers.1.w": torch.randn(5, 3),
        "model.norm.weight": torch.randn(3, dtype=torch.float32).to(torch.bfloat16),
    }

    def stage():
        try:
            group = join_group("127.0.0.1", port, 1, 2, 30)
            received.update(receive_state_dict(group, lambda n: not n.startswith("model.layers.1")))
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    thread = threading.Thread(target=stage)
    thread.start()
    group = join_group("127.0.0.1", port, 0, 2, 30)
    num_bytes = broadcast_state_dict(group, sent)
    thread.join(30)
    assert not errors
    assert num_bytes == sum(t.numel() * t.element_size() for t in sent.values())
    assert set(received) == {"model.layers.0.w", "model.norm.weight"}
    for name, tensor in received.items():
        assert tensor.dtype == sent[name].dtype and torch.equal(tensor, sent[name])


@pytest.mark.parametrize(
    "manifest, problem",
    [
        (b"not json", "not valid JSON"),
        (b'{"tensors": [{"name": "", "dtype": "float32", "shape": [1]}]}', "name"),
        (b'{"tensors": [{"name": "w", "dtype": "int8", "shape": [1]}]}', "dtype"),
        (b'{"tensors": [{"name": "w", "dtype": "float32", "shape": [-1]}]}', "shape"),
        (b'{"tensors": [{"name": "w", "dtype": "float32", "shape": [65536, 65536, 64]}]}', "many"),
        (b'{"tensors": ["w"]}', "name"),
    ],
)
def test_weight_transfer_manifest_refuses_bad_entries(manifest, problem):
    with pytest.raises(TransferError, match=problem):
        decode_manifest(manifest)


class _Context:
    def __init__(self, peer: str):
        self._peer = peer

    def peer(self) -> str:
        return self._peer


@pytest.mark.parametrize(
    "peer, is_local",
    [
        ("ipv4:127.0.0.1:5000", True),
        ("ipv6:[::1]:5000", True),
        ("ipv6:[::ffff:127.0.0.1]:5000", True),
        ("unix:/tmp/sock", True),
        ("ipv4:10.0.0.7:5000", False),
        ("ipv6:[2001:db8::1]:5000", False),
        ("garbage", False),
    ],
)
def test_admin_calls_on_an_open_service_come_from_this_machine_only(peer, is_local):
    assert is_loopback_peer(peer) is is_local
    if is_local:
        require_admin(_Context(peer), OpenAccess())
    else:
        with pytest.raises(PermissionDenied, match="internal token"):
            require_admin(_Context(peer), OpenAccess())
    # With the internal token on, the interceptor has checked the caller: any peer may.
    require_admin(_Context(peer), InternalAuth("secret", requires_certificate=False))
