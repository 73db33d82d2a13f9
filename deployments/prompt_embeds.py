"""``prompt_embeds`` on ``/v1/completions``: a prompt given as embedding rows instead of text.

The value is the base64 of a safetensors file holding exactly one 2-d float tensor
``[num_tokens, hidden_size]`` (vLLM takes a ``torch.save`` file; that is a pickle, which would
let a request run code in the ingress, so we take safetensors, which is plain data). The rows
become one ``engine.embeddings.MMEmbedding`` in the model's run dtype, and the prompt is its
placeholder ids alone (no BOS: the rows are the whole prompt). Page hashes cover the rows'
content, so two requests with the same rows share cached pages and are routed together.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from deployments.protocol import OpenAIError
from engine.embeddings import MMEmbedding

PARAM = "prompt_embeds"
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def embedding_from_body(
    value: Any, hidden_size: int, dtype: torch.dtype, param: str = PARAM, what: str | None = None
) -> MMEmbedding:
    """The request's rows as a container in ``dtype``; a 400 for anything else (not base64,
    not safetensors, not exactly one tensor, wrong shape or dtype, non-finite values) naming
    ``param`` (the body field) and ``what`` (where in it; the field itself by default)."""
    where = f"'{what or param}'"

    def error(problem: str) -> OpenAIError:
        return OpenAIError(f"{where} {problem}", param=param)

    if not isinstance(value, str) or not value:
        raise error("must be a base64 string of a safetensors file")
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise error("is not valid base64") from None
    try:
        tensors = load_safetensors(raw)
    except (SafetensorError, ValueError, RuntimeError):
        raise error("is not a safetensors file") from None
    if len(tensors) != 1:
        raise error(f"must hold exactly one tensor, got {len(tensors)}")
    (rows,) = tensors.values()
    if rows.dim() != 2 or rows.shape[0] == 0 or rows.shape[1] != hidden_size:
        raise error(
            f"must be [num_tokens, {hidden_size}] (the model's hidden size), got {list(rows.shape)}"
        )
    if rows.dtype not in FLOAT_DTYPES:
        raise error(f"must be float16, bfloat16 or float32, got {rows.dtype}")
    if not bool(torch.isfinite(rows).all()):
        raise error("holds non-finite values")
    return MMEmbedding(rows.to(dtype).contiguous())


def encode_rows(rows: torch.Tensor) -> str:
    """The ``prompt_embeds`` value (or a chat ``input_embeds`` part's) for ``rows``."""
    from safetensors.torch import save

    return base64.b64encode(save({"prompt_embeds": rows.contiguous()})).decode("ascii")
