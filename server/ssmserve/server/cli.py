"""The server-side commands of the ``ssmserve`` CLI: ``model`` and ``auth`` (offline).

ssmserve-client owns the ``ssmserve`` command; this distribution adds its commands
through the ``ssmserve.cli`` entry-point group (``add_commands``), so they appear only
when the server is installed::

    ssmserve model init-demo DIR [--input-dim N] [--output-dim N] [--hidden N]
                                 [--layers N] [--state N] [--seed N] [--force]
    ssmserve model inspect DIR [--json]
    ssmserve model run DIR --input IN.npy --output OUT.npy
    ssmserve model bench DIR [--batch B] [--steps N] [--warmup N] [--json]
    ssmserve auth token --tenant T --role client|operator|admin --file TOKENS.toml [--note N]

Server errors become the CLI's one-line ``CliError`` here, at the boundary.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ssmserve.client.atomic_file import atomic_write
from ssmserve.client.errors import CliError
from ssmserve.client.npy_files import load_npy, save_npy
from ssmserve.client.session_commands import positive_int
from ssmserve.server.api.auth import (
    TENANT_PATTERN,
    Role,
    parse_token_file,
    token_entry,
    token_hash,
)
from ssmserve.server.engine.bench import MAX_BATCH, MAX_STEPS, bench_model
from ssmserve.server.engine.demo import ARCHS, DemoSpec, demo_config, random_tensors
from ssmserve.server.engine.loader import (
    CONFIG_FILE,
    INDEX_FILE,
    WEIGHTS_FILE,
    expected_shapes,
    load_model,
    save_model,
)
from ssmserve.server.engine.numerics import blas_signature
from ssmserve.server.errors import ModelInputError, SsmserveError


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``model`` and ``auth`` to the CLI's subcommands (the ``ssmserve.cli`` entry
    point)."""
    _add_auth_commands(commands)
    model = commands.add_parser("model", help="work with model directories offline")
    model_cmds = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")

    init = model_cmds.add_parser(
        "init-demo", help="write a deterministic random signal Mamba or Mamba-2"
    )
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
    init.add_argument(
        "--arch",
        choices=ARCHS,
        default=defaults.arch,
        help="mamba (Mamba-1, selective scan) or mamba2 (multi-head SSD) (default mamba)",
    )
    init.add_argument(
        "--head-dim",
        type=positive_int,
        default=defaults.head_dim,
        help=f"Mamba-2 head dim p (default {defaults.head_dim})",
    )
    init.add_argument(
        "--groups",
        type=positive_int,
        default=defaults.groups,
        help=f"Mamba-2 groups of heads sharing B and C (default {defaults.groups})",
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

    bench = model_cmds.add_parser(
        "bench", help="time batched engine steps of a model on this machine"
    )
    bench.add_argument("dir", type=Path, help="model directory")
    bench.add_argument(
        "--batch", type=positive_int, default=1, help=f"sessions per step, <= {MAX_BATCH} (1)"
    )
    bench.add_argument(
        "--steps", type=positive_int, default=100, help=f"timed steps, <= {MAX_STEPS} (100)"
    )
    bench.add_argument("--warmup", type=positive_int, default=5, help="untimed steps first (5)")
    bench.add_argument(
        "--json", action="store_true", help="print one JSON object (batch, step_us_median, ...)"
    )
    bench.set_defaults(handler=_offline(_bench))


def _add_auth_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    auth = commands.add_parser("auth", help="make bearer tokens for --auth-tokens files")
    auth_cmds = auth.add_subparsers(dest="auth_command", required=True, metavar="ACTION")
    token = auth_cmds.add_parser(
        "token", help="make a random token, append its hash to FILE, print it once (last line)"
    )
    token.add_argument("--tenant", required=True, help="the tenant whose sessions it reaches")
    token.add_argument(
        "--role",
        required=True,
        choices=[r.value for r in Role if r is not Role.WORKER],
        help="client: its tenant's sessions; operator: read all, migrate and drain; "
        "admin: everything",
    )
    token.add_argument("--file", required=True, type=Path, help="the token file (TOML)")
    token.add_argument("--note", default="", help="a note stored with the hash")
    token.set_defaults(handler=_offline(_make_token))


def _make_token(args: argparse.Namespace) -> None:
    if not TENANT_PATTERN.fullmatch(args.tenant):
        raise CliError("--tenant must be 1-64 letters, digits, '.', '_' or '-'")
    path: Path = args.file
    existing = ""
    if path.exists():
        try:
            existing = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise CliError(f"cannot read {path}: {exc}") from None
        parse_token_file(existing, str(path))  # never append to a file the server refuses
    secret = "ssm_" + secrets.token_urlsafe(32)
    entry = token_entry(token_hash(secret), args.tenant, args.role, args.note)
    header = "" if existing else "# ssmserve bearer tokens: sha256 hashes only, never tokens.\n"
    text = existing + ("" if not existing or existing.endswith("\n") else "\n") + header + entry

    def write(tmp: str) -> None:
        Path(tmp).write_text(text)
        os.chmod(tmp, 0o600)

    try:
        atomic_write(path, write)
    except OSError as exc:
        raise CliError(f"cannot write {path}: {exc.strerror or exc}") from None
    print(f"token for tenant {args.tenant} (role {args.role}); its hash is in {path}.")
    print("It is shown only now: keep it secret. Clients pass it as --token or SSMSERVE_TOKEN.")
    print(secret)


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
    existing = [f for f in (CONFIG_FILE, WEIGHTS_FILE, INDEX_FILE) if (directory / f).exists()]
    if existing and not args.force:
        raise CliError(f"{directory} already holds {', '.join(existing)}; pass --force to replace")
    spec = DemoSpec(
        input_dim=args.input_dim,
        output_dim=args.output_dim,
        hidden=args.hidden,
        layers=args.layers,
        state=args.state,
        seed=args.seed,
        arch=args.arch,
        head_dim=args.head_dim,
        groups=args.groups,
    )
    try:
        config = demo_config(spec)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    try:
        save_model(directory, config, random_tensors(config, spec.seed))
    except OSError as exc:
        raise CliError(f"cannot write {directory}: {exc.strerror or exc}") from None
    model = load_model(directory)
    kind = "Mamba-2" if args.arch == "mamba2" else "Mamba"
    print(f"wrote signal {kind} to {directory} (fingerprint {model.fingerprint[:16]})")


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
        **(
            {
                "num_heads": c.num_heads,
                "head_dim": c.head_dim,
                "n_groups": c.n_groups,
                "time_step_limit": list(c.time_step_limit),
            }
            if c.mamba_version == 2
            else {"time_step_rank": c.time_step_rank}
        ),
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


def _bench(args: argparse.Namespace) -> None:
    model = load_model(args.dir)
    result = bench_model(model, args.batch, args.steps, args.warmup)
    if args.json:
        print(json.dumps(result.as_dict()))
        return
    c = model.config
    print(
        f"model       {args.dir} ({c.architecture}, hidden {c.hidden_size}, "
        f"{c.num_hidden_layers} layers, state {c.state_size})\n"
        f"batch       {result.batch} sessions, {result.steps} timed steps "
        f"after {result.warmup} warm-up\n"
        f"step        median {result.step_us_median:,.1f} us   p10 {result.step_us_p10:,.1f} us"
        f"   p90 {result.step_us_p90:,.1f} us\n"
        f"throughput  {result.steps_per_s:,.0f} session-steps/s (batch / median step)\n"
        f"numerics    {result.numerics} (engine alone: no gRPC, no Redis)"
    )
