"""The CLI's commands that move arrays through .npy files: ``session stream``,
``forecast`` and ``generate`` (this module, and numpy with it, is imported only when one
of them runs: ``cli_parsers._on_worker``).

``session stream`` and ``generate`` keep every answer: the output path is checked before
anything is sent, and a run cut part-way (a worker's error, Ctrl-C) saves what was
answered so far and prints the command that goes on from there. A stream goes on with
``--resume`` (from the rows after those whose outputs were saved: the session may no
longer keep the history to answer its first steps again, so they are not resent); a
generation with ``--at-step`` (the step of its last token received: the tokens the
session generated past it are sent again from its log) and ``--append``.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

import numpy as np

from ssmserve.client import cli_constraints, cli_sampling
from ssmserve.client.cli_errors import CliError, rpc_failure
from ssmserve.client.errors import SsmserveClientError, StepFailed
from ssmserve.client.npy_files import load_npy, npy_writer
from ssmserve.client.output_files import check_output, save_elsewhere, write_or_keep, write_output
from ssmserve.client.sync import Client
from ssmserve.v1 import ssmserve_pb2 as pb


def stream(client: Client, args: argparse.Namespace) -> None:
    inputs = load_npy(args.input)
    check_output(args.output)
    if args.resume and args.first_step is None:
        raise CliError(
            "--resume goes on from the rows of --input after those already answered: give "
            "--first-step S, the step of its first row (the command printed when the "
            "stream was cut has it)"
        )
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
    done = _resumed(args, info, outputs, first, last) if args.resume else 0
    start = first + done  # the first step this run sends
    try:
        for out in client.stream_steps(
            sid, rows[done:], first_step=start,
            steps_per_message=max(1, args.steps_per_message), last_outputs_only=last_only,
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


def _resumed(
    args: argparse.Namespace, info: pb.SessionInfo, outputs: np.ndarray, first: int, last: int
) -> int:
    """``--resume``: how many rows (from ``first``) are done already, their outputs put in
    ``outputs`` from ``--output``. Rows whose steps the session no longer has (it came
    back behind them) count as not done; with ``--last-only`` every step it took is done
    but the last (whose output is still wanted: it is answered from its record)."""
    taken = max(0, min(info.step, last) - first + 1)  # rows whose steps the session took
    if args.last_only:
        return max(0, min(taken, last - first))
    if not args.output.exists():
        raise CliError(
            f"--resume: {args.output} does not exist; it holds the outputs of the rows a "
            "cut stream answered, to go on after. Without it, run without --resume (the "
            "rows from --first-step are sent again)"
        )
    saved = load_npy(args.output)
    width = outputs.shape[1]
    if saved.ndim != 2 or saved.shape[1] != width or len(saved) > len(outputs):
        raise CliError(
            f"--resume: {args.output} holds {list(saved.shape)}, not the outputs of at most "
            f"{len(outputs)} rows of {width} values; is it this stream's --output?"
        )
    done = min(len(saved), taken)
    outputs[:done] = saved[:done]
    return done


def _go_on(args: argparse.Namespace, command: list[str]) -> str:
    """The command line that runs ``command`` against the same worker, quoted for a shell
    (the token is left out: it belongs in SSMSERVE_TOKEN, not on a screen)."""
    words = ["ssmserve", "--server", args.server]
    for flag in ("ca", "cert", "key"):
        path = getattr(args, f"tls_{flag}", None)
        if path is not None:
            words += [f"--tls-{flag}", str(path)]
    return shlex.join([*words, *command])


def _stream_advice(args: argparse.Namespace, first: int) -> str:
    """How to go on with this stream, ending with the command line to run."""
    return (
        f"to go on, run the same command with --first-step {first} --resume: "
        f"{_stream_go_on(args, first)}"
    )


def _stream_go_on(args: argparse.Namespace, first: int) -> str:
    """The command that goes on with this stream after the rows already answered."""
    command = ["session", "stream", args.session_id, "--input", str(args.input),
               "--output", str(args.output), "--first-step", str(first), "--resume"]  # fmt: skip
    if args.steps_per_message != 64:
        command += ["--steps-per-message", str(args.steps_per_message)]
    if args.last_only:
        command.append("--last-only")
    return _go_on(args, command)


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
    """Save the outputs of the ``done`` rows answered (from ``first``) before a stream was
    cut; what was saved where, and the command that goes on, as the end of the error's
    line. (With --last-only nothing is saved: only the last step's output is kept, and it
    was not answered.)"""
    go_on = _stream_advice(args, first)
    if args.last_only:
        if not done:
            return f"no step of {first}..{last} was answered; nothing was written; {go_on}"
        upto = first + done - 1
        return (
            f"steps {first}..{upto} of {first}..{last} were answered (--last-only keeps only "
            f"step {last}'s output, so nothing was written); {go_on}"
        )
    answered = outputs[:done]
    if not len(answered):
        return f"no step of {first}..{last} was answered; nothing was written; {go_on}"
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
        go_on = f"put that file at {args.output}, then {_stream_advice(args, first)}"
    return (
        f"steps {first}..{upto} of {first}..{last} were answered and their {len(answered)} "
        f"outputs saved in {where} (--resume sends the rows after them and writes every "
        f"row's output); {go_on}"
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
    a guard, an error or Ctrl-C ended early: then it says how to go on and exits 2, or
    130 on Ctrl-C)."""
    if args.output is not None:
        check_output(args.output)
    if args.prompt is not None and args.prompt_ids is not None:
        raise CliError("give --prompt-ids or --prompt, not both")
    before = _appended_to(args)
    sid = args.session_id
    info = client.get_session(sid)
    as_text = args.prompt is not None or _has_tokenizer(client, info)
    prompt = None
    if args.prompt_ids is not None:
        ids = load_npy(args.prompt_ids)
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise CliError(f"{args.prompt_ids}: a prompt is int token ids of shape (T,)")
        prompt = [int(i) for i in ids]
    at = info.step if args.at_step is None else args.at_step
    rules, held = cli_constraints.options(args), cli_constraints.HeldText(args)
    sampling, last = cli_sampling.options(args), None
    tokens: list[int] = []
    first, reached = None, at  # reached: the step of the last token received
    try:
        for t in client.generate(
            sid, args.max_tokens, prompt_ids=prompt, prompt_text=args.prompt or "",
            at_step=at, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
            min_p=args.min_p, seed=args.seed, stop_token_ids=args.stop, **sampling, **rules,
        ):  # fmt: skip
            first = t.step if first is None else first
            if t.retracted_after_step is not None:  # the text monitor withdrew these
                del tokens[max(t.retracted_after_step - first + 1, 0) :]
            tokens.append(t.token_id)
            reached, last = t.step, t
            if as_text:
                print(held.push(t.step, t.text, t.retracted_after_step), end="", flush=True)
            else:
                print(t.token_id, flush=True)
            cli_sampling.print_logprobs(t)
            for event in t.guard_events:
                print(f"step {t.step}: guard {event.guard}: {event.detail}", file=sys.stderr)
    except KeyboardInterrupt:
        if as_text and tokens:
            print(held.flush(), flush=True)
        where = _keep_generated(args, before, tokens)
        advice = _generate_advice(args, len(tokens), at, reached)
        print(f"ssmserve: interrupted; {len(tokens)} tokens were generated{where}{advice}",
              file=sys.stderr)  # fmt: skip
        raise
    except SsmserveClientError as exc:
        if as_text and tokens:
            print(held.flush())
        where = _keep_generated(args, before, tokens)
        advice = (
            "" if isinstance(exc, StepFailed) else _generate_advice(args, len(tokens), at, reached)
        )  # a guard's refusal would end the same way again
        raise CliError(
            f"{rpc_failure(exc)}; {len(tokens)} tokens were generated{where}{advice}"
        ) from None
    if as_text:
        print(held.flush())  # the text's line ends
    where = _keep_generated(args, before, tokens)
    steps = f"steps {first}..{first + len(tokens) - 1}" if tokens else "no step"
    note = cli_sampling.finish_note(last)
    print(f"generated {len(tokens)} tokens ({steps} of {sid}){where}{note}", file=sys.stderr)


def _appended_to(args: argparse.Namespace) -> np.ndarray:
    """``--append``: the ids already in ``--output`` (none without --append)."""
    if not args.append:
        return np.empty(0, np.int64)
    if args.output is None:
        raise CliError("--append adds the generated ids to those in --output: give --output")
    if not args.output.exists():
        raise CliError(
            f"--append: {args.output} does not exist; it holds the ids of the generation to "
            "go on with. Without it, run without --append"
        )
    ids = load_npy(args.output)
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise CliError(
            f"--append: {args.output} holds {ids.dtype} {list(ids.shape)}, not token ids "
            "(N,); is it a generation's --output?"
        )
    return ids.astype(np.int64)


def _generate_advice(args: argparse.Namespace, received: int, at: int, reached: int) -> str:
    """The end of a cut generation's message: the command that goes on with it (nothing
    when every token came). With tokens received it asks from the last one's step, without
    the prompt (fed); the tokens the session generated past it come again from its log,
    checked to be this generation's draws (the same settings), so the whole is the
    uninterrupted generation. With none, it asks from where this one started, with the
    prompt: the part of it already fed is checked and not fed again."""
    left = args.max_tokens - received
    if left <= 0:
        return ""
    command = ["generate", args.session_id, "--max-tokens", str(left),
               "--at-step", str(reached if received else at)]  # fmt: skip
    defaults = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 0}
    for name, default in defaults.items():
        value = getattr(args, name)
        if value != default:
            command += [f"--{name.replace('_', '-')}", str(value)]
    for stop in args.stop:
        command += ["--stop", str(stop)]
    command += cli_sampling.go_on_flags(args)
    if not received and args.prompt_ids is not None:
        command += ["--prompt-ids", str(args.prompt_ids)]
    if not received and args.prompt is not None:
        command += ["--prompt", args.prompt]
    if args.output is not None:
        command += ["--output", str(args.output), "--append"]
    return f"; to go on, run: {_go_on(args, command)}"


def _has_tokenizer(client: Client, info: pb.SessionInfo) -> bool:
    """Whether the model the session runs is served with a tokenizer (by its owner)."""
    served = client.list_models(info.owner).models
    return any(m.key == info.model and m.tokenizer_fingerprint for m in served)


def _keep_generated(args: argparse.Namespace, before: np.ndarray, tokens: list[int]) -> str:
    """Write the ids (those ``--append`` found, then ``tokens``) to ``--output``, if given;
    where they are, as the end of a message."""
    if args.output is None:
        return ""
    ids = np.concatenate([before, np.asarray(tokens, np.int64)])
    where = write_or_keep(
        args.output, npy_writer(ids), f"{args.session_id}-generated", ".npy",
        f"the {len(tokens)} tokens were generated",
    )  # fmt: skip
    kept = f" (after the {len(before)} it held)" if len(before) else ""
    return f"; ids in {where}{kept}"
