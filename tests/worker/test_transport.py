"""PipelineLink's receives posted ahead (`expect_*`), over a group that records its calls."""

from __future__ import annotations

import torch

from services.worker.transport import PipelineLink


class RecordingGroup:
    """Stands in for a process group: notes each receive posted, completes it at once."""

    def __init__(self) -> None:
        self.recvs: list[tuple[list[int], int, int]] = []

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int):
        self.recvs.append((list(tensors[0].shape), src, tag))
        return self

    def wait(self) -> bool:
        return True


def test_link_posts_receives_ahead_on_gloo_only():
    """Gloo (CPU) posts each expected receive at once, and hands them out in that order;
    NCCL (CUDA) posts nothing ahead: its sends and receives between two stages run in one
    stream in posting order, so a receive posted ahead held the stage's own sends to that
    peer back (2 stages: a deadlock)."""
    group = RecordingGroup()
    link = PipelineLink(1, 2, torch.device("cpu"), group)
    link.expect_hidden(3, 8, torch.float32)
    link.expect_tokens(2)
    assert len(group.recvs) == 2
    assert link.recv_hidden(3, 8, torch.float32).shape == (3, 8)
    assert link.recv_tokens(2).shape == (2,)
    assert len(group.recvs) == 2  # taken from those posted, none posted again

    group = RecordingGroup()
    link = PipelineLink(1, 2, torch.device("cuda"), group)
    link.expect_hidden(3, 8, torch.float32)
    link.expect_tokens(2)
    assert group.recvs == []
