"""The CLI's commands that move arrays through .npy files: ``session stream``,
``forecast`` and ``generate`` (this module, and numpy with it, is imported only when one
of them runs: ``cli_parsers._on_worker``).

``session stream`` keeps every answer: the output path is checked before anything is
sent, and a stream cut part-way (a worker's error, Ctrl-C) saves the outputs of the
steps answered so far and says how to go on: ``--first-step`` with the same first step
resends the answered steps, which the session answers from its record without applying
them again.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

from ssmserve.client.cli_errors import CliError, rpc_failure
from ssmserve.client.errors import SsmserveClientError, StepFailed
from ssmserve.client.npy_files import load_npy, npy_writer
from ssmserve.client.output_files import check_output, save_elsewhere, write_or_keep, write_output
from ssmserve.client.sync import Client
from ssmserve.v1 import ssmserve_pb2 as pb


def stream(client: Client, args: argparse.Namespace) -> None:
    inputs = load_npy(args.input)
    check_output(args.output)
    sid = args.session_id
    info = client.get_session(sid)
    rows = _step_rows(inputs, info, args.input)
    first = args.first_step if args.first_step is not None else info.step + 1
    if first > info.step + 1:
        raise CliError(
            f"--first-step {first} skips ahead: session {sid} is at step {info.step}, so "
            f"its next step is {info.step + 1}; nothing was sent"
        )
    last = first + len(rows) - 1
    last_only = args.last_only
    # --last-only: one row, the last step's output (the others are answered without one).
    outputs = np.empty((1 if last_only else len(rows), info.output_dim), np.float32)
    done = 0
    try:
        for out in client.stream_steps(
            sid, rows, first_step=first, steps_per_message=max(1, args.steps_per_message),
            last_outputs_only=last_only,
        ):  # fmt: skip
            if not last_only:
                outputs[done] = out.output
            elif out.step == last:
                outputs[0] = out.output
            for event in out.guard_events:
                print(f"step {out.step}: guard {event.guard}: {event.detail}", file=sys.stderr)
            done += 1
    except KeyboardInterrupt:
        print(f"ssmserve: interrupted; {_keep_answered(args, outputs, done, first, last)}",
              file=sys.stderr)  # fmt: skip
        raise
    except SsmserveClientError as exc:
        where = f"step {exc.step}: " if isinstance(exc, StepFailed) else ""
        raise CliError(
            f"{where}{rpc_failure(exc)}; {_keep_answered(args, outputs, done, first, last)}"
        ) from None
    where = write_or_keep(
        args.output, npy_writer(outputs), f"{sid}-steps-{first}-{last}", ".npy",
        f"all {len(rows)} steps ({first}..{last}) were applied",
    )  # fmt: skip
    print(
        f"streamed {done} steps (session {sid} at step {last}: steps {first}..{last}); "
        f"outputs in {where}"
    )


def _step_rows(inputs: np.ndarray, info: pb.SessionInfo, path: Path) -> list[Any]:
    """The rows of ``inputs`` as the session's model takes them; CliError if they do not
    fit it (before anything is sent)."""
    if info.token_input:
        if inputs.ndim != 1 or not np.issubdtype(inputs.dtype, np.integer):
            raise CliError(f"{path}: a token model takes int ids of shape (T,)")
        return [int(t) for t in inputs]
    if inputs.ndim != 2 or inputs.shape[1] != info.input_dim:
        raise CliError(f"{path}: expected shape (T, {info.input_dim}), got {list(inputs.shape)}")
    return list(np.asarray(inputs, np.float32))


def _keep_answered(
    args: argparse.Namespace, outputs: np.ndarray, done: int, first: int, last: int
) -> str:
    """Save the outputs of the ``done`` steps answered before a stream was cut; what was
    saved where, and how to go on, as the end of the error's line. (With --last-only
    nothing is saved: only the last step's output is kept, and it was not answered.)"""
    answered = outputs[:done]
    if args.last_only and done:
        upto = first + done - 1
        return (
            f"steps {first}..{upto} of {first}..{last} were answered (--last-only keeps only "
            f"step {last}'s output, so nothing was written); to go on, run the same command "
            f"with --first-step {first} (answered steps are sent back from the session's "
            "record, not applied again)"
        )
    if not len(answered):
        return f"no step of {first}..{last} was answered; nothing was written"
    upto = first + len(answered) - 1
    try:
        write_output(args.output, npy_writer(answered))
        where = str(args.output)
    except OSError:
        try:
            where = str(save_elsewhere(f"{args.session_id}-steps-{first}-{upto}", ".npy",
                                       npy_writer(answered)))  # fmt: skip
        except OSError as exc:
            where = f"nowhere (cannot write {args.output} nor a temp file: {exc.strerror})"
    return (
        f"steps {first}..{upto} of {first}..{last} were answered and their {len(answered)} "
        f"outputs saved in {where}; to go on, run the same command with --first-step "
        f"{first} (answered steps are sent back from the session's record, not applied "
        "again)"
    )


def forecast(client: Client, args: argparse.Namespace) -> None:
    if args.output is not None:
        check_output(args.output)
    fc = client.forecast(args.session_id, args.horizon, at_step=args.at_step)
    for event in fc.guard_events:
        print(f"step {event.step}: guard {event.guard}: {event.detail}", file=sys.stderr)
    if args.output is not None:
        write_or_keep(
            args.output, npy_writer(fc.outputs), f"{args.session_id}-forecast", ".npy",
            f"the forecast of {len(fc.outputs)} steps was run",
        )  # fmt: skip
    else:
        for i, step in enumerate(fc.steps):
            if fc.tokens is not None:
                print(f"step {step}: token {fc.tokens[i]} (logit {fc.outputs[i].max():.6g})")
            else:
                print(f"step {step}: " + " ".join(f"{v:.6g}" for v in fc.outputs[i]))
    where = f"; outputs in {args.output}" if args.output is not None else ""
    if fc.stopped is not None:
        raise CliError(
            f"the forecast stopped after {len(fc.outputs)} of {args.horizon} steps "
            f"({fc.stopped.reason}): {fc.stopped.message}{where}"
        )
    print(
        f"forecast of {len(fc.outputs)} steps from step {fc.from_step} of {args.session_id} "
        f"(the session is unchanged){where}"
    )


def generate(client: Client, args: argparse.Namespace) -> None:
    """The text on stdout as it comes when the session's model has a tokenizer, else
    token ids, one per line; the ids in ``--output`` if given (also those of a generation
    a guard or an error ended early: then it exits 2)."""
    if args.output is not None:
        check_output(args.output)
    if args.prompt is not None and args.prompt_ids is not None:
        raise CliError("give --prompt-ids or --prompt, not both")
    as_text = args.prompt is not None or _has_tokenizer(client, args.session_id)
    prompt = None
    if args.prompt_ids is not None:
        ids = load_npy(args.prompt_ids)
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise CliError(f"{args.prompt_ids}: a prompt is int token ids of shape (T,)")
        prompt = [int(i) for i in ids]
    sid = args.session_id
    tokens: list[int] = []
    first = None
    try:
        for t in client.generate(
            sid, args.max_tokens, prompt_ids=prompt, prompt_text=args.prompt or "",
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
            min_p=args.min_p, seed=args.seed, stop_token_ids=args.stop,
        ):  # fmt: skip
            first = t.step if first is None else first
            tokens.append(t.token_id)
            if as_text:
                print(t.text, end="", flush=True)
            else:
                print(t.token_id, flush=True)
            for event in t.guard_events:
                print(f"step {t.step}: guard {event.guard}: {event.detail}", file=sys.stderr)
    except SsmserveClientError as exc:
        if as_text and tokens:
            print()
        where = _keep_generated(args, tokens)
        raise CliError(f"{rpc_failure(exc)}; {len(tokens)} tokens were generated{where}") from None
    if as_text:
        print()  # the text's line ends
    where = _keep_generated(args, tokens)
    steps = f"steps {first}..{first + len(tokens) - 1}" if tokens else "no step"
    print(f"generated {len(tokens)} tokens ({steps} of {sid}){where}", file=sys.stderr)


def _has_tokenizer(client: Client, session_id: str) -> bool:
    """Whether the model the session runs is served with a tokenizer (by its owner)."""
    info = client.get_session(session_id)
    served = client.list_models(info.owner).models
    return any(m.key == info.model and m.tokenizer_fingerprint for m in served)


def _keep_generated(args: argparse.Namespace, tokens: list[int]) -> str:
    if args.output is None:
        return ""
    where = write_or_keep(
        args.output, npy_writer(np.asarray(tokens, np.int64)), f"{args.session_id}-generated",
        ".npy", f"the {len(tokens)} tokens were generated",
    )  # fmt: skip
    return f"; ids in {where}"
