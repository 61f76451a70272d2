"""Attention backends over the depth-aware paged KV cache."""

from rlt_serve.attention.backend import AttentionBackend, AttentionMetadata, RowSpec, get_attention_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "RowSpec", "get_attention_backend"]
