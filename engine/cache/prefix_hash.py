"""Chained page hashes: the one definition of "shared prefix" for the engine and the router.

A full page's hash covers its token ids *and* its parent's hash, so equal hashes mean equal
whole prefixes up to the end of that page. The router imports this module so that it and the
engine agree, page for page, on what a replica has cached.

Per-job embeddings (``engine.embeddings``) appear in a prompt as placeholder ids that differ
from container to container, even for equal content. A page hashes each placeholder as a
sentinel id plus (container identity, row offset), so the same rows at the same place give
the same hash in any request, and different rows under the same text never match.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import NewType, Protocol

PageHash = NewType("PageHash", int)

_DIGEST_BYTES = 16  # 128 bits: collisions are not a practical concern
_PLACEHOLDER = -1  # stands for an embedding row in the hashed ids (never a real token id)


class EmbeddingSpan(Protocol):
    """What hashing needs of a per-job embedding container (``engine.embeddings.MMEmbedding``):
    its placeholder ids ``first_id .. first_id + num_tokens - 1`` and its content identity."""

    @property
    def first_id(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def identity(self) -> bytes: ...


def page_hash(
    parent: PageHash | None,
    token_ids: Sequence[int],
    extra: bytes = b"",
    embeddings: Sequence[EmbeddingSpan] = (),
) -> PageHash:
    """Hash of one full page given its parent's hash (None for the first page).

    ``extra`` carries anything else that changes the page's K/V; pages with different
    ``extra`` never match. ``embeddings``: the sequence's containers, whose placeholder ids
    are hashed by identity and row offset (see the module docstring).
    """
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    h.update(b"\x00" if parent is None else parent.to_bytes(_DIGEST_BYTES, "little"))
    rows = b""
    if embeddings:
        token_ids, rows = _embedding_rows(token_ids, embeddings)
    h.update(array("q", token_ids).tobytes())
    if extra:
        h.update(b"\x01" + extra)
    if rows:
        h.update(b"\x02" + rows)
    return PageHash(int.from_bytes(h.digest(), "little"))


def _embedding_rows(
    token_ids: Sequence[int], embeddings: Sequence[EmbeddingSpan]
) -> tuple[list[int], bytes]:
    """Token ids with each placeholder replaced by a sentinel, and the (identity, offset) of
    each placeholder in order."""
    lowest = min(e.first_id for e in embeddings)
    ids = list(token_ids)
    rows = []
    for i, token in enumerate(ids):
        if token < lowest:
            continue
        for e in embeddings:
            offset = token - e.first_id
            if 0 <= offset < e.num_tokens:
                ids[i] = _PLACEHOLDER
                rows.append(e.identity + offset.to_bytes(8, "little"))
                break
    return ids, b"".join(rows)


def salt_root(cache_salt: str | None) -> PageHash | None:
    """The parent hash of a salted sequence's first page (None without a salt).

    A salt (a tenant's secret, as vLLM's ``cache_salt``) enters the first page's hash and so,
    by chaining, every later one: sequences with different salts never share a page, so one
    tenant cannot learn by timing whether another's prompt is cached. Router and engine both
    start their chains here.
    """
    if cache_salt is None:
        return None
    h = hashlib.blake2b(cache_salt.encode("utf-8"), digest_size=_DIGEST_BYTES, person=b"cache-salt")
    return PageHash(int.from_bytes(h.digest(), "little"))


def prefix_hashes(
    token_ids: Sequence[int],
    page_size: int,
    extra: bytes = b"",
    parent: PageHash | None = None,
    embeddings: Sequence[EmbeddingSpan] = (),
) -> list[PageHash]:
    """Hashes of every *full* page of ``token_ids`` (a trailing partial page has none);
    ``embeddings``: the containers whose placeholder ids appear in ``token_ids``."""
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    hashes: list[PageHash] = []
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        parent = page_hash(parent, token_ids[start : start + page_size], extra, embeddings)
        hashes.append(parent)
    return hashes
