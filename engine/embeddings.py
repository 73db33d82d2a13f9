"""Per-job embedding containers: rows from any encoder, placed in a prompt by placeholder ids.

A multimodal prompt is text with embedding rows spliced in (an image's patches from a vision
tower, an audio clip's frames...). The user runs the encoder; the engine takes its output:

    image = MMEmbedding(vision_rows)                  # [n, hidden] in the model's dtype
    ids = tokenizer.encode(f"Describe {image.text_alias}.", embeddings=[image])
    generator.enqueue(DynamicJob(ids, 64, embeddings=[image]))

``tokenizer.encode`` turns the alias into ``n`` placeholder ids from a range past any
vocabulary (``EMBEDDING_ID_BASE`` and up, a range of its own per container in this process);
the model's embedding step writes the container's rows at those positions (``EmbeddingTable``,
built once per forward batch, applied as one index_copy). Prefix caching hashes a placeholder
as (container identity, row offset), never as its raw id, so the same content in two
requests shares pages and different content under the same text never does
(``engine.cache.prefix_hash``).
"""

from __future__ import annotations

import hashlib
import itertools
import re
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

# Far past any tokenizer's vocabulary; sampled ids never reach it, so a placeholder can only
# come from a container.
EMBEDDING_ID_BASE = 1_000_000_000
ALIAS_PATTERN = re.compile(r"<\$EMB_\d+\$>")
_IDENTITY_BYTES = 16

_allocation_lock = threading.Lock()
_aliases = itertools.count()
_next_id = EMBEDDING_ID_BASE


def _allocate(num_tokens: int) -> tuple[int, int]:
    """(alias serial, first placeholder id) of a new container; ranges never overlap."""
    global _next_id
    with _allocation_lock:
        first = _next_id
        _next_id += num_tokens
        return next(_aliases), first


def content_identity(rows: torch.Tensor) -> bytes:
    """A 128-bit hash of a tensor's dtype, shape and values: equal content, equal identity."""
    data = rows.detach().contiguous().cpu()
    h = hashlib.blake2b(digest_size=_IDENTITY_BYTES, person=b"mm-embedding")
    h.update(f"{data.dtype}:{tuple(data.shape)}".encode())
    h.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.digest()


class MMEmbedding:
    """A container of embedding rows ``[n, hidden]`` (the model's dtype) for one prompt.

    ``text_alias`` (``<$EMB_17$>``) marks where the rows go in a prompt's text; the
    placeholder ids are ``first_id .. first_id + n - 1``; ``identity`` is the content hash
    that prefix caching uses. ``model``: check hidden size and dtype now (the generator checks
    them again at enqueue either way).
    """

    __slots__ = ("embeddings", "first_id", "identity", "num_tokens", "text_alias")

    def __init__(self, embeddings: torch.Tensor, model=None):
        if not isinstance(embeddings, torch.Tensor) or embeddings.dim() != 2:
            raise ValueError("embeddings must be a 2-d tensor [num_tokens, hidden_size]")
        if embeddings.shape[0] == 0 or not embeddings.is_floating_point():
            raise ValueError(
                f"embeddings must hold at least one row of floats, got shape "
                f"{tuple(embeddings.shape)} {embeddings.dtype}"
            )
        self.embeddings = embeddings.detach()
        self.num_tokens = int(embeddings.shape[0])
        serial, self.first_id = _allocate(self.num_tokens)
        self.text_alias = f"<$EMB_{serial}$>"
        self.identity = content_identity(self.embeddings)
        if model is not None:
            self.check_model(model.config.hidden_size, model.dtype)

    @property
    def placeholder_ids(self) -> range:
        return range(self.first_id, self.first_id + self.num_tokens)

    def check_model(self, hidden_size: int, dtype: torch.dtype) -> None:
        """ValueError unless the rows fit a model of ``hidden_size`` running in ``dtype``."""
        if self.embeddings.shape[1] != hidden_size:
            raise ValueError(
                f"embedding {self.text_alias} has rows of {self.embeddings.shape[1]} values; "
                f"the model's hidden size is {hidden_size}"
            )
        if self.embeddings.dtype != dtype:
            raise ValueError(
                f"embedding {self.text_alias} is {self.embeddings.dtype}; the model runs in "
                f"{dtype} (convert the rows first)"
            )

    def __repr__(self) -> str:
        return (
            f"MMEmbedding({self.text_alias}, {self.num_tokens} x {self.embeddings.shape[1]}, "
            f"{self.embeddings.dtype}, identity={self.identity.hex()[:12]})"
        )


def find_aliases(
    text: str, embeddings: Sequence[MMEmbedding]
) -> list[tuple[int, int, MMEmbedding]]:
    """(start, end, container) of each alias in ``text``, in order.

    ValueError for an alias without its container, a container whose alias is absent, or the
    same container given twice."""
    by_alias: dict[str, MMEmbedding] = {}
    for e in embeddings:
        if not isinstance(e, MMEmbedding):
            raise ValueError(f"embeddings must be MMEmbedding containers, got {type(e).__name__}")
        if e.text_alias in by_alias:
            raise ValueError(f"embedding {e.text_alias} is given twice")
        by_alias[e.text_alias] = e
    found: list[tuple[int, int, MMEmbedding]] = []
    for match in ALIAS_PATTERN.finditer(text):
        container = by_alias.get(match.group())
        if container is None:
            raise ValueError(f"{match.group()} is in the text but its embedding is not given")
        found.append((match.start(), match.end(), container))
    used = {e.text_alias for _, _, e in found}
    missing = [alias for alias in by_alias if alias not in used]
    if missing:
        raise ValueError(f"embeddings {missing} are given but their aliases are not in the text")
    return found


def split_on_aliases(text: str, embeddings: Sequence[MMEmbedding]) -> list[str | MMEmbedding]:
    """``text`` as text pieces and the containers whose aliases stand between them
    (ValueError as ``find_aliases``)."""
    parts: list[str | MMEmbedding] = []
    cursor = 0
    for start, end, container in find_aliases(text, embeddings):
        parts += [text[cursor:start], container]
        cursor = end
    parts.append(text[cursor:])
    return [p for p in parts if not isinstance(p, str) or p]


def check_prompt(
    input_ids: Sequence[int],
    embeddings: Sequence[MMEmbedding],
    vocab_size: int,
    hidden_size: int,
    dtype: torch.dtype,
) -> None:
    """A job's prompt against its containers: ids outside the vocabulary must be placeholders
    of its own containers, each container must fit the model and appear in the prompt."""
    spans = [(e.first_id, e.first_id + e.num_tokens) for e in embeddings]
    bad = [
        t
        for t in input_ids
        if not 0 <= t < vocab_size and not any(lo <= t < hi for lo, hi in spans)
    ]
    if bad:
        raise ValueError(f"input_ids {bad[:5]} are outside the vocabulary (size {vocab_size})")
    if not embeddings:
        return
    present = set(input_ids)
    for e in embeddings:
        if not isinstance(e, MMEmbedding):
            raise ValueError(f"embeddings must be MMEmbedding containers, got {type(e).__name__}")
        e.check_model(hidden_size, dtype)
        if e.first_id not in present:
            raise ValueError(f"embedding {e.text_alias} has no placeholder ids in input_ids")
    spans.sort()
    if any(a[1] > b[0] for a, b in itertools.pairwise(spans)):
        raise ValueError("a job's embeddings overlap (the same container given twice?)")


@dataclass(frozen=True, slots=True)
class EmbeddingTable:
    """Rows to substitute in one forward batch: ``rows[k]`` goes to batch token
    ``positions[k]`` (both on the batch's device)."""

    positions: torch.Tensor  # [K] long
    rows: torch.Tensor  # [K, hidden]


@dataclass(slots=True)
class EmbeddingTableBuilder:
    """Collects the placeholder positions of a batch's rows while the batch is flattened."""

    positions: list[int] = field(default_factory=list)
    sources: list[tuple[int, int]] = field(default_factory=list)  # (container, row offset)
    containers: dict[int, MMEmbedding] = field(default_factory=dict)  # id() -> container

    def add(self, token_ids: Iterable[int], start: int, embeddings: Sequence[MMEmbedding]) -> None:
        """Token ``i`` of ``token_ids`` sits at batch row ``start + i``."""
        lowest = min(e.first_id for e in embeddings)
        for i, token in enumerate(token_ids):
            if token < lowest:
                continue
            for e in embeddings:
                offset = token - e.first_id
                if 0 <= offset < e.num_tokens:
                    self.containers.setdefault(id(e), e)
                    self.positions.append(start + i)
                    self.sources.append((id(e), offset))
                    break

    def build(self, device: torch.device | str) -> EmbeddingTable | None:
        """The batch's table (one gather over the used containers), None without placeholders."""
        if not self.positions:
            return None
        base: dict[int, int] = {}
        total = 0
        for key, e in self.containers.items():
            base[key] = total
            total += e.num_tokens
        stacked = torch.cat([e.embeddings for e in self.containers.values()]).to(device)
        index = torch.tensor([base[key] + off for key, off in self.sources], dtype=torch.long)
        return EmbeddingTable(
            positions=torch.tensor(self.positions, dtype=torch.long).to(device),
            rows=stacked.index_select(0, index.to(device)),
        )
