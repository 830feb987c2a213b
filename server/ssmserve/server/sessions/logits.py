"""What a draw reads from a step's logits before it draws: penalties, bias, logprobs.

A generated token is the session's next input, so the penalties read the session's own
inputs: the last ``penalty_last_n`` inputs up to the step whose logits are drawn from
(prompt and generated ids alike, as llama.cpp's ``penalty_last_n``). They are a pure
function of the session's history, so a replay, a fork or a resumed call adjusts the same
logits the same way. In float64, in this fixed order (:func:`adjusted`):

1. repetition (HF's ``RepetitionPenaltyLogitsProcessor``, CTRL's): each id seen in the
   window has a positive logit divided by ``repetition_penalty``, a negative one
   multiplied by it (once, however often it was seen);
2. presence and frequency (OpenAI's): each seen id's logit less ``presence_penalty``
   once and ``frequency_penalty`` x its count in the window;
3. ``logit_bias``: each listed id's logit plus its bias.

Then the draw (``sampling.draw``): temperature, top-k, softmax, top-p, min-p.

Logprobs (:func:`logprobs`) are of the adjusted logits' softmax: after the penalties and
the bias, before temperature and the filters (the model's distribution as the request
shaped it, the same whatever the temperature); a token's ``logprob`` field keeps its
meaning, the log-probability under the filtered distribution it was drawn from.

The window is read once per call (:func:`penalty_window`): from the session's memory (its
recent inputs: at least its ``history_window``, which checkpoints carry, so a fork or a
migrated or reloaded session has them too), else its input log. Inputs older than both
(a fork's steps before its fork point past its history window, or a log cut by snapshot
retention) are not in the window.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ssmserve.server.sessions.replay import Replay
from ssmserve.server.sessions.sampling import SamplingParams
from ssmserve.server.sessions.session import Session
from ssmserve.server.state.store_errors import StoreError, StoreUnavailableError


def adjusted(logits: np.ndarray, params: SamplingParams, window: Sequence[int]) -> np.ndarray:
    """``logits`` (V,) float32 widened to float64 with the penalties over ``window`` (the
    session's inputs, oldest first, at most ``penalty_last_n``) and ``logit_bias`` applied;
    a new array."""
    z = np.asarray(logits, np.float32).astype(np.float64)
    if len(window) and params.penalty_last_n:
        seen, counts = np.unique(np.asarray(window, np.int64), return_counts=True)
        r = params.repetition_penalty
        if r != 1.0:
            values = z[seen]
            z[seen] = np.where(values > 0.0, values / r, values * r)
        if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
            z[seen] -= params.presence_penalty + params.frequency_penalty * counts
    for token, bias in params.logit_bias:
        z[token] += bias
    return z


@dataclass(frozen=True)
class Logprobs:
    chosen: float  # the drawn token's
    top: tuple[tuple[int, float], ...]  # (id, logprob), most likely first, ties: lower id


def logprobs(z: np.ndarray, chosen: int, top_n: int) -> Logprobs:
    """The log-softmax of ``z`` (float64, as :func:`adjusted` gives; float32 is widened)
    at ``chosen`` and its ``top_n`` largest finite entries (fewer when fewer are finite:
    a constraint's mask)."""
    z = np.asarray(z, np.float64)
    top = float(z.max())
    with np.errstate(under="ignore"):
        log_total = top + float(np.log(np.exp(z - top).sum()))
    ranked: tuple[tuple[int, float], ...] = ()
    if top_n > 0:
        n = min(top_n, len(z))
        threshold = np.partition(z, len(z) - n)[len(z) - n]
        candidates = np.flatnonzero(z >= threshold)  # ascending ids, ties included
        order = candidates[np.argsort(-z[candidates], kind="stable")][:n]
        # A masked or -Inf id has probability 0: never one of the most likely (and -Inf
        # is no number JSON can carry).
        ranked = tuple((int(i), float(z[i] - log_total)) for i in order if z[i] > -np.inf)
    return Logprobs(float(z[chosen] - log_total), ranked)


async def penalty_window(replay: Replay, s: Session, step: int, n: int) -> deque[int]:
    """The session's inputs of steps ``step - n + 1 .. step`` (from step 1), oldest
    first: the newest ones it still holds in memory or its log, back to the first it
    does not."""
    window: deque[int] = deque(maxlen=n)
    first = max(1, step - n + 1)
    held: list[bytes] = []
    at = step
    while at >= first and (raw := s.recent.input_at(at)) is not None:
        held.append(raw)
        at -= 1
    held.reverse()
    older: list[bytes] = []
    if at >= first:
        _count, oldest = await replay.store.snapshot_count_and_oldest(s.id)
        low = max(first, (oldest or 0) + 1)
        try:
            older = await replay.inputs(s, low, at) if low <= at else []
        except StoreUnavailableError:
            raise  # not known: a window guessed smaller would draw other tokens
        except StoreError:
            older = []  # the log no longer holds them: the window is what memory has
    raw_inputs = older + held
    if raw_inputs:
        window.extend(int(t) for t in s.codec.decode_many(raw_inputs))
    return window
