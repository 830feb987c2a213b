"""Ctrl-C, then the command the CLI says to run: it works, and the result is whole.

- ``session stream`` cut at step ~1,000 of 3,000 on a session that keeps little history (its
  first steps are older than its oldest kept snapshot, so resending them is refused):
  the command it prints goes on from the answered steps, and --output ends up holding the
  outputs of every step, bit for bit, each step applied once.
- ``generate`` cut part-way saves the ids generated so far and prints a command that goes
  on: the ids then in --output are the uninterrupted generation's (same seed).

The CLI runs as a real process against a real worker and Redis; Ctrl-C is a SIGINT.
"""

from __future__ import annotations

import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from tests.conftest import random_inputs

REPO = Path(__file__).resolve().parent.parent
SAMPLING = ["--temperature", "0.9", "--top-k", "20", "--seed", "77"]


def started(argv: list[str]) -> subprocess.Popen[str]:
    # Ctrl-C's default action in the CLI, whatever this process inherited (a test run in
    # the background of a shell has SIGINT ignored, which children inherit).
    return subprocess.Popen(
        [sys.executable, "-m", "ssmserve.client.cli", *argv], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, cwd=REPO,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip


def interrupt_when(proc: subprocess.Popen[str], ready, what: str) -> str:
    """SIGINT once ``ready()``; the CLI's stderr (it must exit 130, interrupted)."""
    deadline = time.monotonic() + 120
    while not ready():
        assert proc.poll() is None, f"the CLI ended before {what}: {proc.communicate()}"
        assert time.monotonic() < deadline, f"no {what} in 120 s"
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.startswith("ssmserve: interrupted; "), err
    return err


def go_on(err: str) -> subprocess.CompletedProcess[str]:
    """Run the command the CLI said to run to go on (the end of its last line)."""
    advice = err.strip().splitlines()[-1]
    assert "to go on, " in advice and ": ssmserve " in advice, err
    argv = shlex.split("ssmserve " + advice.rsplit(": ssmserve ", 1)[1])
    return subprocess.run(
        [sys.executable, "-m", "ssmserve.client.cli", *argv[1:]],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip


def test_a_long_stream_cut_by_ctrl_c_goes_on_with_the_command_it_prints(
    worker, served_models, tmp_path
):
    model = served_models["demo"]
    # Eight snapshots 64 steps apart kept: a resend of step 1 is refused (ROLLBACK_RANGE)
    # long before the cut, as on a long stream at the default retention; the steps sent but
    # not answered when the CLI stopped (at most RetryPolicy.window) are still in reach.
    sid = worker.client.create_session("demo", snapshot_every=64, max_snapshots=8).session_id
    x = random_inputs(model, 3_000, seed=496)
    np.save(tmp_path / "in.npy", x)
    out = tmp_path / "out.npy"
    proc = started(["--server", worker.address, "session", "stream", sid,
                    "--input", str(tmp_path / "in.npy"), "--output", str(out),
                    "--steps-per-message", "1"])  # fmt: skip
    err = interrupt_when(proc, lambda: worker.client.get_session(sid).step >= 1_000, "step 1000")
    answered = len(np.load(out))
    assert f"steps 1..{answered} of 1..3000 were answered" in err
    want = model.run(x)[0]
    np.testing.assert_array_equal(np.load(out), want[:answered])

    done = go_on(err)
    assert done.returncode == 0, done.stderr
    np.testing.assert_array_equal(np.load(out), want)  # every step's output, in one file
    assert f"session {sid} at step 3000" in done.stdout
    assert worker.client.get_session(sid).step == 3000
    history = worker.client.history(sid, from_step=2_980)
    np.testing.assert_array_equal(history.outputs, want[2_979:])


def test_generate_cut_by_ctrl_c_keeps_its_tokens_and_goes_on(worker, tmp_path):
    prompt = np.array([3, 1, 4, 1, 5, 9, 2, 6], np.int64)
    np.save(tmp_path / "prompt.npy", prompt)
    reference = worker.client.create_session("lm").session_id
    want = [
        t.token_id
        for t in worker.client.generate(
            reference, 3_000, prompt_ids=list(prompt), temperature=0.9, top_k=20, seed=77
        )
    ]
    sid = worker.client.create_session("lm").session_id
    out = tmp_path / "ids.npy"
    proc = started(["--server", worker.address, "generate", sid, "--max-tokens", "3000",
                    "--prompt-ids", str(tmp_path / "prompt.npy"), "--output", str(out),
                    *SAMPLING])  # fmt: skip
    err = interrupt_when(
        proc, lambda: worker.client.get_session(sid).step >= len(prompt) + 300, "300 tokens"
    )
    kept = np.load(out)
    assert 0 < len(kept) < 3_000 and f"{len(kept)} tokens were generated" in err, err
    assert list(kept) == want[: len(kept)]

    done = go_on(err)
    assert done.returncode == 0, done.stderr
    assert list(np.load(out)) == want  # the whole generation, as if never cut
    assert worker.client.get_session(sid).step == len(prompt) + 3_000
