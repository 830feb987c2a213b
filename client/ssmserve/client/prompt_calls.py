"""The asyncio client's prompt call: :meth:`AsyncPromptCalls.prefill`, the last output only.

:class:`~ssmserve.client.aio.AsyncClient` inherits :class:`AsyncPromptCalls`. A prompt is
sent as whole messages of consecutive steps with ``StreamRequest.last_outputs_only``: the
worker prefills each message's steps as one run and computes only the outputs it answers
with, so a 512-token prompt costs one row of logits, not 512. It goes through
``stream_steps``, so a cut stream resumes where the session is served, with the flag.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from ssmserve.client.step_values import SessionRef, StepOutput

#: Steps per message of ``prefill``: each message is one run the worker prefills (in
#: chunks of its ``prefill_batch_steps``), well under its 4096-step message limit.
PREFILL_STEPS_PER_MESSAGE = 1024


class AsyncPromptCalls:
    """Prompts: a session fed many inputs, only the last output wanted."""

    def stream_steps(
        self, session: SessionRef, inputs: Any, **options: Any
    ) -> AsyncIterator[StepOutput]:
        raise NotImplementedError  # AsyncClient's

    async def prefill(
        self,
        session: SessionRef,
        inputs: Sequence[Any],
        *,
        first_step: int | None = None,
        steps_per_message: int = PREFILL_STEPS_PER_MESSAGE,
    ) -> StepOutput:
        """Send ``inputs`` (a prompt's token ids, or vectors) as the session's next steps
        and return the last step's StepOutput: its output (next-token logits) is the only
        one computed and sent back (``stream_steps`` with ``last_outputs_only``, whole
        messages of ``steps_per_message`` steps, each prefilled by the worker at matrix
        speed). ``first_step`` as in ``stream_steps``; a cut stream resumes the same way.
        Raises ValueError for no inputs, and what ``stream_steps`` raises."""
        if not len(inputs):
            raise ValueError("prefill needs at least one input")
        last: StepOutput | None = None
        async for out in self.stream_steps(
            session,
            inputs,
            first_step=first_step,
            steps_per_message=steps_per_message,
            last_outputs_only=True,
        ):
            last = out
        assert last is not None
        return last
