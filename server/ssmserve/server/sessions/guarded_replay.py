"""Replay of a session whose guards carry state (``stateful_guards``): the same decisions.

The log holds the inputs as the client sent them, so a replay judges each step again from
the guard state of the snapshot it starts at: every logged step was applied, and a step
the live session imputed is imputed again (its input depends on the step before's
output). Prefill computes the bits of stepping, so the replay runs optimistically as
prefills of the inputs as sent, judging the outputs in order; at the first step the input
rules impute, the state before it is made again (a prefill of the steps before it), the
step runs with its imputed input, and the replay goes on from there with a window of one
step that doubles each time a window passes without an imputation (a stuck sensor, imputed
at every step, costs a step per step, not a prefill of the rest per step).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ssmserve.server.engine.lane import EngineLane
from ssmserve.server.engine.recurrent_state import SessionState
from ssmserve.server.sessions.guards import GuardRule
from ssmserve.server.sessions.stateful_guards import InputVerdict, judge_input, judge_step
from ssmserve.server.state.checkpoint import GuardState


async def replay_guarded(
    lane: EngineLane,
    rules: Sequence[GuardRule],
    guards: GuardState,
    inputs: np.ndarray,
    state: SessionState,
    first: int,
) -> tuple[list[np.ndarray], SessionState, GuardState]:
    """Logged ``inputs`` (as sent) of steps ``first ..`` from ``state`` and ``guards``:
    the outputs as answered, the state and the guard state after the last."""
    outputs: list[np.ndarray] = []
    count, at, window = len(inputs), 0, len(inputs)
    while at < count:
        size = min(window, count - at)
        rows, after = await lane.prefill(inputs[at : at + size], state, "all")
        g = guards
        imputed: tuple[int, InputVerdict] | None = None
        for k in range(size):
            before = judge_input(rules, g, first + at + k, inputs[at + k])
            if before.imputed is not None:
                imputed = (k, before)
                break
            verdict = judge_step(rules, g, first + at + k, before, rows[k], logged=True)
            g = verdict.state
            outputs.append(verdict.output)
        if imputed is None:
            state, guards, at, window = after, g, at + size, window * 2
            continue
        k, before = imputed
        if k:
            _rows, state = await lane.prefill(inputs[at : at + k], state, "none")
        row, state = await lane.prefill(before.applied[None], state, "all")
        verdict = judge_step(rules, g, first + at + k, before, row[0], logged=True)
        outputs.append(verdict.output)
        guards, at, window = verdict.state, at + k + 1, 1
    return outputs, state, guards
