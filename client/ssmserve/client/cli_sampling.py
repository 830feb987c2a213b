"""``ssmserve generate``'s stop rules, penalties, logit bias and logprobs: its flags, the
options they give ``generate``, and what it prints of a token's logprobs and of the end.

Only argparse at import (``cli_parsers`` imports this to build the parser).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ssmserve.client.generation import GeneratedToken


def add_flags(gen: argparse.ArgumentParser) -> None:
    gen.add_argument("--stop-text", action="append", default=[], metavar="TEXT",
                     help="end when the text contains TEXT, not printed (repeatable, at "
                     "most 16; a model with a tokenizer)")  # fmt: skip
    gen.add_argument("--ignore-eos", action="store_true",
                     help="go on past the model's end-of-sequence token")  # fmt: skip
    gen.add_argument("--repetition-penalty", type=float, default=1.0, metavar="R",
                     help="a seen token's logit divided by R if positive, multiplied if "
                     "negative; 1 (default): off; [0.01, 10]")  # fmt: skip
    gen.add_argument("--presence-penalty", type=float, default=0.0, metavar="P",
                     help="subtracted once from a seen token's logit; [-2, 2]")  # fmt: skip
    gen.add_argument("--frequency-penalty", type=float, default=0.0, metavar="F",
                     help="subtracted per time a token was seen; [-2, 2]")  # fmt: skip
    gen.add_argument("--penalty-last-n", type=int, default=None, metavar="N",
                     help="the penalties look at the session's last N inputs (default 64, "
                     "at most 4096)")  # fmt: skip
    gen.add_argument("--logit-bias", action="append", default=[], type=_bias, metavar="ID=B",
                     help="add B in [-100, 100] to token ID's logit (repeatable)")  # fmt: skip
    gen.add_argument("--logprobs", type=int, default=None, metavar="N",
                     help="print each token's logprob and its N (0..20) most likely "
                     "alternatives on stderr")  # fmt: skip


def _bias(text: str) -> tuple[int, float]:
    token, sep, bias = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected ID=BIAS (e.g. 50256=-100), got {text!r}"
        ) from None


def options(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of ``Client.generate`` these flags give."""
    return {
        "stop": args.stop_text,
        "ignore_eos": args.ignore_eos,
        "repetition_penalty": args.repetition_penalty,
        "presence_penalty": args.presence_penalty,
        "frequency_penalty": args.frequency_penalty,
        "penalty_last_n": args.penalty_last_n,
        "logit_bias": dict(args.logit_bias),
        "logprobs": args.logprobs is not None,
        "top_logprobs": args.logprobs or 0,
    }


def print_logprobs(t: GeneratedToken) -> None:
    """``--logprobs``: one line on stderr per token."""
    if t.unfiltered_logprob is None:
        return
    top = " ".join(f"{x.token_id}{_text(x.text)}:{x.logprob:.4f}" for x in t.top_logprobs)
    print(
        f"step {t.step}: token {t.token_id}{_text(t.text)} logprob {t.unfiltered_logprob:.4f}"
        + (f" top {top}" if top else ""),
        file=sys.stderr,
    )


def _text(text: str) -> str:
    return f"({text!r})" if text else ""


def finish_note(last: GeneratedToken | None) -> str:
    """How the generation ended, for the summary line ('' when it did not say)."""
    if last is None or not last.finish_reason:
        return ""
    matched = f" {last.stop_string!r}" if last.stop_string else ""
    return f", finished: {last.finish_reason}{matched}"


def go_on_flags(args: argparse.Namespace) -> list[str]:
    """These flags as given (the defaults left out), for the command that goes on with a
    cut generation: the same settings draw the same tokens."""
    flags: list[str] = [arg for text in args.stop_text for arg in ("--stop-text", text)]
    if args.ignore_eos:
        flags.append("--ignore-eos")
    defaults = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
    for name, default in defaults.items():
        if getattr(args, name) != default:
            flags += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if args.penalty_last_n is not None:
        flags += ["--penalty-last-n", str(args.penalty_last_n)]
    flags += [arg for token, bias in args.logit_bias for arg in ("--logit-bias", f"{token}={bias}")]
    if args.logprobs is not None:
        flags += ["--logprobs", str(args.logprobs)]
    return flags
