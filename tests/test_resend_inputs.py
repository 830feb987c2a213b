"""A resend is the same request again: a step the session already took is answered with
its recorded output only if it carries the input the step was taken with. Other inputs
are refused with INPUT_MISMATCH (FAILED_PRECONDITION), and nothing changes, whether the
input is still in memory or only in the log."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from ssmserve.client.errors import SsmserveClientError
from ssmserve.client.step_values import step_input
from ssmserve.v1 import ssmserve_pb2 as pb
from tests.conftest import random_inputs
from tests.test_service import assert_bit_equal, reference, stream, stub


@pytest.mark.parametrize("history_window", [256, 1], ids=["in-memory", "from-the-log"])
def test_a_resend_with_other_inputs_is_refused_and_changes_nothing(
    worker, served_models, history_window
):
    model = served_models["demo"]
    x = random_inputs(model, 8, seed=49)
    want = reference(model, x)
    sid = worker.client.create_session("demo", history_window=history_window).session_id
    stream(worker, sid, x[:6])

    # The same inputs again: the recorded answers.
    again = list(worker.client.stream_steps(sid, list(x[2:4]), first_step=3))
    assert [o.step for o in again] == [3, 4]
    assert_bit_equal(np.stack([o.output for o in again]), want[2:4])

    # Another input at step 3, alone or after a true resend of step 2.
    for first, inputs in ((3, [x[2] + 1.0]), (2, [x[1], x[2] * -1.0])):
        with pytest.raises(SsmserveClientError) as refused:
            list(worker.client.stream_steps(sid, inputs, first_step=first))
        assert refused.value.reason == "INPUT_MISMATCH"
        assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "step 3" in str(refused.value) and "roll it back to step 2" in str(refused.value)

    # Nothing changed: the session goes on from step 6 as if no resend had come.
    assert worker.client.get_session(sid).step == 6
    got, _ = stream(worker, sid, x[6:8], first_step=7)
    assert_bit_equal(got, want[6:8])


def test_a_resend_in_one_message_with_its_step_must_match_too(worker, served_models):
    """Step 3 sent twice in one message (applied, then resent with another input)."""
    model = served_models["demo"]
    x = random_inputs(model, 4, seed=50)
    sid = worker.client.create_session("demo").session_id
    stream(worker, sid, x[:2])
    steps = [step_input(sid, 3, x[2]), step_input(sid, 3, x[2] + 1.0), step_input(sid, 3, x[2])]
    (response,) = stub(worker).Stream(iter([pb.StreamRequest(steps=steps)]), timeout=30)
    first, mismatch, same = response.results
    assert not first.HasField("error") and not same.HasField("error")
    assert mismatch.error.reason == "INPUT_MISMATCH"
    assert list(same.output.values) == list(first.output.values)
    assert worker.client.get_session(sid).step == 3
