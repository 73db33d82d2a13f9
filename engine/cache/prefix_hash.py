"""Chained page hashes: the one definition of "shared prefix" for the engine and the router.

A full page's hash covers its token ids *and* its parent's hash, so equal hashes mean equal
whole prefixes up to the end of that page. The router imports this module so that it and the
engine agree, page for page, on what a replica has cached.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import NewType

PageHash = NewType("PageHash", int)

_DIGEST_BYTES = 16  # 128 bits: collisions are not a practical concern


def page_hash(parent: PageHash | None, token_ids: Sequence[int], extra: bytes = b"") -> PageHash:
    """Hash of one full page given its parent's hash (None for the first page).

    ``extra`` carries anything besides token ids that changes the page's K/V (for example the
    identity of per-job embeddings); pages with different ``extra`` never match.
    """
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    h.update(b"\x00" if parent is None else parent.to_bytes(_DIGEST_BYTES, "little"))
    h.update(array("q", token_ids).tobytes())
    if extra:
        h.update(b"\x01" + extra)
    return PageHash(int.from_bytes(h.digest(), "little"))


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
) -> list[PageHash]:
    """Hashes of every *full* page of ``token_ids`` (a trailing partial page has none)."""
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    hashes: list[PageHash] = []
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        parent = page_hash(parent, token_ids[start : start + page_size], extra)
        hashes.append(parent)
    return hashes
