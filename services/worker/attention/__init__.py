"""Attention over the paged KV cache: the metadata and the backends (PyTorch, Triton)."""

from services.kernels.metadata import AttentionMetadata

__all__ = ["AttentionMetadata"]
