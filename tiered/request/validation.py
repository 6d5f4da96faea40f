"""What a request must be, checked once, at the engine's edge.

Torch-free: the API process checks each call's lists of ids before any prompt of it reaches the
engine (a 400 naming the field); a caller in the engine's process is checked by `Engine.submit`
with the same functions. Past that edge nothing checks again (the engine process queues what the
API sent with `Engine.enqueue`; the forward checks only its items' shapes). The messages are
vLLM's where vLLM has one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


class InputError(ValueError):
    """A request the model cannot compute (empty, too long, an id outside the vocabulary).
    `param` names the request field when the caller knows it (the API's 400 names it)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def check_token_ids(ids: Sequence[int], vocab_size: int, param: str | None = None) -> None:
    """Every id inside [0, vocab_size), or InputError naming the first one outside."""
    for t in ids:
        if not 0 <= t < vocab_size:
            where = f" (in {param})" if param else ""
            raise InputError(f"token id {t} is outside the vocabulary [0, {vocab_size}){where}", param)


def check_prompt(ids: Sequence[int], vocab_size: int, max_model_len: int, param: str | None = None) -> None:
    """A prompt the engine accepts: at least one token, at most max_model_len, all in the vocabulary."""
    if len(ids) == 0:
        raise InputError(f"{param or 'the prompt'} is empty: it must contain at least one token", param)
    if len(ids) > max_model_len:
        raise InputError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested {len(ids)} "
            "tokens in the prompt. Please reduce the length of the prompt.",
            param,
        )
    check_token_ids(ids, vocab_size, param)


# A call's priority lies strictly between these: the values at and past them are the engine's own
# (`tiered.scheduler.scheduler.WARM_PRIORITY` ranks below every call), and a 64-bit integer carries it.
PRIORITY_LIMIT = 1 << 62


def check_priority(value: object, param: str = "priority") -> None:
    """vLLM's request priority (lower runs first): an integer in (-PRIORITY_LIMIT, PRIORITY_LIMIT);
    else InputError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or not -PRIORITY_LIMIT < value < PRIORITY_LIMIT:
        bound = PRIORITY_LIMIT - 1
        raise InputError(f"{param} must be an integer in [-{bound}, {bound}] (lower runs first), got {value!r}", param)


def check_slo_ms(value: object, param: str = "slo_ms") -> None:
    """A latency objective: None (none), or a finite number of milliseconds in (0, 1e9]; else
    InputError naming it."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not (math.isfinite(value) and 0 < value <= 1e9):
        raise InputError(f"{param} must be a number of milliseconds in (0, 1e9], got {value!r}", param)
