"""The server-side commands of the ``ssmserve`` CLI: ``ssmserve model ...`` (offline).

ssmserve-client owns the ``ssmserve`` command; this distribution adds its commands
through the ``ssmserve.cli`` entry-point group (``add_commands``), so they appear only
when the server is installed::

    ssmserve model init-demo DIR [--input-dim N] [--output-dim N] [--hidden N]
                                 [--layers N] [--state N] [--seed N] [--force]
    ssmserve model inspect DIR [--json]
    ssmserve model run DIR --input IN.npy --output OUT.npy

Server errors become the CLI's one-line ``CliError`` here, at the boundary.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ssmserve.client.errors import CliError
from ssmserve.client.npy_files import load_npy, save_npy
from ssmserve.client.session_commands import positive_int
from ssmserve.server.engine.demo import DemoSpec, demo_config, random_tensors
from ssmserve.server.engine.loader import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    expected_shapes,
    load_model,
    save_model,
)
from ssmserve.server.engine.numerics import blas_signature
from ssmserve.server.errors import ModelInputError, SsmserveError


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``model`` to the CLI's subcommands (the ``ssmserve.cli`` entry point)."""
    model = commands.add_parser("model", help="work with model directories offline")
    model_cmds = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")

    init = model_cmds.add_parser("init-demo", help="write a deterministic random signal Mamba")
    init.add_argument("dir", type=Path, help="directory to write config.json and weights to")
    defaults = DemoSpec()
    for flag, attr, help_text in (
        ("--input-dim", "input_dim", "width of each input vector"),
        ("--output-dim", "output_dim", "width of each output vector"),
        ("--hidden", "hidden", "hidden size d"),
        ("--layers", "layers", "number of Mamba blocks"),
        ("--state", "state", "SSM state size n"),
    ):
        init.add_argument(
            flag,
            type=positive_int,
            default=getattr(defaults, attr),
            help=f"{help_text} (default {getattr(defaults, attr)})",
        )
    init.add_argument("--seed", type=int, default=defaults.seed, help="weights seed (default 0)")
    init.add_argument("--force", action="store_true", help="overwrite an existing model in DIR")
    init.set_defaults(handler=_offline(_init_demo))

    inspect = model_cmds.add_parser("inspect", help="show a model's architecture and fingerprint")
    inspect.add_argument("dir", type=Path, help="model directory")
    inspect.add_argument("--json", action="store_true", help="print JSON")
    inspect.set_defaults(handler=_offline(_inspect))

    run = model_cmds.add_parser("run", help="step a whole sequence from a fresh state")
    run.add_argument("dir", type=Path, help="model directory")
    run.add_argument("--input", required=True, type=Path, help="(T,) int ids or (T, i) float32")
    run.add_argument("--output", required=True, type=Path, help="where to write (T, o) float32")
    run.set_defaults(handler=_offline(_run))


def _offline(
    command: Callable[[argparse.Namespace], None],
) -> Callable[[argparse.Namespace], None]:
    def handler(args: argparse.Namespace) -> None:
        try:
            command(args)
        except SsmserveError as exc:
            raise CliError(str(exc)) from None

    return handler


def _init_demo(args: argparse.Namespace) -> None:
    directory: Path = args.dir
    existing = [f for f in (CONFIG_FILE, WEIGHTS_FILE) if (directory / f).exists()]
    if existing and not args.force:
        raise CliError(f"{directory} already holds {', '.join(existing)}; pass --force to replace")
    spec = DemoSpec(
        input_dim=args.input_dim,
        output_dim=args.output_dim,
        hidden=args.hidden,
        layers=args.layers,
        state=args.state,
        seed=args.seed,
    )
    config = demo_config(spec)
    try:
        save_model(directory, config, random_tensors(config, spec.seed))
    except OSError as exc:
        raise CliError(f"cannot write {directory}: {exc.strerror or exc}") from None
    model = load_model(directory)
    print(f"wrote signal Mamba to {directory} (fingerprint {model.fingerprint[:16]})")


def describe(directory: Path) -> dict[str, object]:
    model = load_model(directory)
    c = model.config
    params = sum(int(np.prod(shape)) for shape in expected_shapes(c).values())
    info: dict[str, object] = {
        "name": model.name,
        "architecture": str(c.architecture),
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_hidden_layers,
        "intermediate_size": c.intermediate_size,
        "state_size": c.state_size,
        "conv_kernel": c.conv_kernel,
        "time_step_rank": c.time_step_rank,
        "input": "token id" if c.is_token_model else f"float32[{c.input_dim}]",
        "output": f"logits[{c.vocab_size}]" if c.is_token_model else f"float32[{c.output_dim}]",
        "parameters": params,
        "state_bytes_per_session": c.state_bytes,
        "fingerprint": model.fingerprint,
        "blas": blas_signature(),
    }
    return info


def _inspect(args: argparse.Namespace) -> None:
    info = describe(args.dir)
    if args.json:
        print(json.dumps(info, indent=2))
        return
    width = max(len(k) for k in info)
    for key, value in info.items():
        shown = f"{value:,}" if isinstance(value, int) else value
        print(f"{key.replace('_', ' '):<{width}}  {shown}")


def _run(args: argparse.Namespace) -> None:
    model = load_model(args.dir)
    inputs = load_npy(args.input)
    c = model.config
    if c.is_token_model:
        if inputs.ndim != 1 or not np.issubdtype(inputs.dtype, np.integer):
            raise ModelInputError(
                f"{args.input}: token model needs integer ids of shape (T,), "
                f"got {inputs.dtype}{list(inputs.shape)}"
            )
    elif inputs.dtype != np.float32 or inputs.ndim != 2 or inputs.shape[1] != c.input_dim:
        raise ModelInputError(
            f"{args.input}: signal model needs float32 of shape (T, {c.input_dim}), "
            f"got {inputs.dtype}{list(inputs.shape)}"
        )
    try:
        outputs, _ = model.run(inputs)
    except ModelInputError as exc:
        raise ModelInputError(f"{args.input}: {exc}") from None
    save_npy(args.output, outputs)
    print(f"wrote {outputs.shape[0]} steps of {outputs.shape[1]} outputs to {args.output}")
