"""Classifier-free guidance over HTTP: ``cfg_scale`` with a negative prompt.

``cfg_scale`` (a number in ``CFG_SCALE_RANGE``) goes with ``negative_prompt`` on
``/v1/completions`` (a string or token ids, like ``prompt``) or ``negative_messages`` on
``/v1/chat/completions`` (a conversation, like ``messages``, ``input_embeds`` parts included).
Each choice then runs as the engine's ``[positive, negative]`` job (``engine.cfg``): the two
prompts' logits are mixed as ``cfg * log_softmax(l_pos) + (1 - cfg) * log_softmax(l_neg)``
before the rest of sampling, so 1 is the plain positive prompt and 0 the negative one.

Half a pair is refused, and so is what a CFG job cannot do (``engine.job._check_cfg_options``):
per-token logprobs and constrained output (``response_format``, a forced tool call), which act
on one row while a CFG job samples a merged one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from deployments.protocol import OpenAIError, number_field

if TYPE_CHECKING:
    from deployments.protocol import RequestFields

CFG_SCALE_RANGE = (-10.0, 10.0)
NEGATIVE_FIELD = {False: "negative_prompt", True: "negative_messages"}  # by chat


def parse_cfg_scale(body: dict[str, Any], chat: bool) -> float | None:
    """The body's ``cfg_scale``, None without guidance; a 400 for half a pair."""
    scale = number_field(body, "cfg_scale", *CFG_SCALE_RANGE)
    negative = NEGATIVE_FIELD[chat]
    if scale is None and body.get(negative) is not None:
        raise OpenAIError(
            f"'{negative}' needs 'cfg_scale' (classifier-free guidance)", param=negative
        )
    if scale is not None and body.get(negative) is None:
        raise OpenAIError(
            f"'cfg_scale' needs '{negative}' (the negative prompt)", param="cfg_scale"
        )
    return scale


def check_guided_fields(fields: RequestFields, chat: bool) -> None:
    """Refuse the options a CFG job cannot honour, naming the field that asked for them."""
    if fields.settings.cfg_scale is None:
        return
    if fields.logprobs is not None:
        raise OpenAIError("'logprobs' cannot be combined with 'cfg_scale'", param="logprobs")
    for name in ("banned_strings", "token_healing"):  # per-row features a CFG job lacks
        if getattr(fields, name):
            raise OpenAIError(f"'{name}' cannot be combined with 'cfg_scale'", param=name)
    if fields.constraint is not None:
        param = (fields.constraint_source or "response_format").split(".")[0]
        message = f"'{param}' (constrained output) cannot be combined with 'cfg_scale'"
        raise OpenAIError(message, param=param)
