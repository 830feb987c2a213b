"""The server-side commands of the ``ssmserve`` CLI: ``model`` and ``auth`` (offline).

ssmserve-client owns the ``ssmserve`` command; this distribution adds its commands
through the ``ssmserve.cli`` entry-point group (``add_commands``), so they appear only
when the server is installed::

    ssmserve model init-demo DIR [--input-dim N] [--output-dim N] [--hidden N]
                                 [--layers N] [--state N] [--seed N] [--force]
    ssmserve model init-demo DIR --preset mamba-130m|mamba2-130m|mamba-790m|mamba-2.8b|
                                          falcon-mamba-7b|mamba-codestral-7b [--seed N]
    ssmserve model inspect DIR [--json]
    ssmserve model run DIR --input IN.npy --output OUT.npy [--prefill] [--engine cpu|cuda]
    ssmserve model bench DIR [--batch B] [--steps N] [--warmup N] [--prefill T]
                             [--rounds N] [--json] [--engine cpu|cuda]
    ssmserve model bench DIR --checkpoint [--json]
    ssmserve auth token --tenant T --role client|operator|admin --file TOKENS.toml [--note N]

Only argparse here: the CLI loads this module to list the commands and parse their
flags, every time it needs its full command list (``ssmserve --help``), and a command's
code (``offline_commands``: the engine, numba, the token file) is imported only when
that command runs. Hence the engine's limits and defaults the flags show are written
here too; ``tests/test_cli.py`` checks they equal the engine's.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from pathlib import Path

from ssmserve.client.cli_parsers import Subparsers, file_flag, positive_int

#: ``engine.demo.DemoSpec()``'s fields the flags set, and their defaults.
DEMO_DEFAULTS = {
    "input_dim": 4, "output_dim": 4, "hidden": 64, "layers": 2, "state": 16,
    "seed": 0, "arch": "mamba", "head_dim": 16, "groups": 2,
}  # fmt: skip
ARCHS = ("mamba", "mamba2")  # engine.demo.ARCHS
PRESETS = (
    "mamba-130m", "mamba2-130m", "mamba-790m", "mamba-2.8b", "falcon-mamba-7b",
    "mamba-codestral-7b",
)  # engine.presets.PRESETS  # fmt: skip
MAX_BATCH = 4096  # engine.bench.MAX_BATCH
MAX_STEPS = 1_000_000  # engine.bench.MAX_STEPS
MAX_PREFILL = 1 << 20  # engine.bench.MAX_PREFILL
TOKEN_ROLES = ("client", "operator", "admin")  # api.auth.Role, less the workers' own
ENGINES = ("cpu", "cuda")  # cpu: engine.mamba (numpy, numba); cuda: engine.gpu (Triton)
QUANTIZATIONS = ("none", "q8_0")  # engine.quantize.QUANTIZATIONS (not imported: CLI start)


def _engine_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--engine",
        choices=ENGINES,
        default="cpu",
        help="cpu (default): the numba engine; cuda: the Triton engine on a GPU (needs "
        "ssmserve[cuda]; without a GPU only under TRITON_INTERPRET=1, small models)",
    )
    parser.add_argument(
        "--quantize",
        choices=QUANTIZATIONS,
        default="none",
        help="none (default): each weight at its stored precision (BF16 stays 16-bit); "
        "q8_0: the products' weights in llama.cpp's Q8_0 (cpu engine)",
    )


def _handler(name: str) -> Callable[[argparse.Namespace], None]:
    """Runs ``offline_commands.<name>`` (imported then) with the server's errors as
    the CLI's one-line errors."""

    def handler(args: argparse.Namespace) -> None:
        commands = importlib.import_module("ssmserve.server.offline_commands")
        commands.offline(getattr(commands, name), args)

    return handler


def add_commands(commands: Subparsers) -> None:
    """Add ``model`` and ``auth`` to the CLI's subcommands (the ``ssmserve.cli`` entry
    point)."""
    _add_auth_commands(commands)
    model = commands.add_parser("model", help="work with model directories offline")
    model_cmds = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")

    init = model_cmds.add_parser(
        "init-demo", help="write a deterministic random signal Mamba or Mamba-2"
    )
    init.add_argument("dir", type=Path, help="directory to write config.json and weights to")
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
            default=DEMO_DEFAULTS[attr],
            help=f"{help_text} (default {DEMO_DEFAULTS[attr]})",
        )
    init.add_argument(
        "--arch",
        choices=ARCHS,
        default=DEMO_DEFAULTS["arch"],
        help="mamba (Mamba-1, selective scan) or mamba2 (multi-head SSD) (default mamba)",
    )
    init.add_argument(
        "--head-dim",
        type=positive_int,
        default=DEMO_DEFAULTS["head_dim"],
        help=f"Mamba-2 head dim p (default {DEMO_DEFAULTS['head_dim']})",
    )
    init.add_argument(
        "--groups",
        type=positive_int,
        default=DEMO_DEFAULTS["groups"],
        help=f"Mamba-2 groups of heads sharing B and C (default {DEMO_DEFAULTS['groups']})",
    )
    init.add_argument(
        "--seed", type=int, default=DEMO_DEFAULTS["seed"], help="weights seed (default 0)"
    )
    init.add_argument(
        "--preset",
        choices=PRESETS,
        help="instead of a signal model, a language model at a released checkpoint's shapes "
        "with random weights: mamba-130m (F32, 0.5 GB), mamba2-130m (F32, 0.5 GB), "
        "mamba-790m (F32, 3.2 GB), mamba-2.8b (BF16, 5.5 GB), falcon-mamba-7b (BF16, "
        "14.6 GB), mamba-codestral-7b (BF16, 14.6 GB); refused, with the figures, where "
        "it would not fit on the disk or could not be loaded here; the shape flags do not "
        "go with it",
    )
    init.add_argument("--force", action="store_true", help="overwrite an existing model in DIR")
    init.set_defaults(handler=_handler("init_demo"))

    inspect = model_cmds.add_parser("inspect", help="show a model's architecture and fingerprint")
    inspect.add_argument("dir", type=Path, help="model directory")
    inspect.add_argument("--json", action="store_true", help="print JSON")
    inspect.set_defaults(handler=_handler("inspect"))

    run = model_cmds.add_parser("run", help="step a whole sequence from a fresh state")
    run.add_argument("dir", type=Path, help="model directory")
    file_flag(run, "--input", "(T,) int ids or (T, i) float32", metavar="IN.npy")
    file_flag(run, "--output", "where to write (T, o) float32", metavar="OUT.npy")
    run.add_argument(
        "--prefill",
        action="store_true",
        help="compute layer by layer over the whole sequence (faster; the same bits)",
    )
    _engine_flag(run)
    run.set_defaults(handler=_handler("run"))

    bench = model_cmds.add_parser(
        "bench", help="time batched engine steps of a model on this machine"
    )
    bench.add_argument("dir", type=Path, help="model directory")
    bench.add_argument(
        "--checkpoint",
        action="store_true",
        help="time the checkpoint codec on a random state of the model's shapes (reads only "
        "its config) beside a memory copy of the same bytes: encode_ms, decode_ms, memcpy_ms",
    )
    bench.add_argument(
        "--batch", type=positive_int, default=1, help=f"sessions per step, <= {MAX_BATCH} (1)"
    )
    bench.add_argument(
        "--steps", type=positive_int, default=100, help=f"timed steps, <= {MAX_STEPS} (100)"
    )
    bench.add_argument("--warmup", type=positive_int, default=5, help="untimed steps first (5)")
    bench.add_argument(
        "--prefill",
        type=positive_int,
        metavar="T",
        help=f"time a T-input prompt's prefill (<= {MAX_PREFILL}) and batch-1 decode steps",
    )
    bench.add_argument(
        "--rounds", type=positive_int, default=5, help="prefills timed with --prefill (5)"
    )
    bench.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (batch, step_us_median, ...; prefill_ms with --prefill)",
    )
    _engine_flag(bench)
    bench.set_defaults(handler=_handler("bench"))


def _add_auth_commands(commands: Subparsers) -> None:
    auth = commands.add_parser("auth", help="make bearer tokens for --auth-tokens files")
    auth_cmds = auth.add_subparsers(dest="auth_command", required=True, metavar="ACTION")
    token = auth_cmds.add_parser(
        "token", help="make a random token, append its hash to FILE, print it once (last line)"
    )
    token.add_argument("--tenant", required=True, help="the tenant whose sessions it reaches")
    token.add_argument(
        "--role",
        required=True,
        choices=TOKEN_ROLES,
        help="client: its tenant's sessions; operator: read all, migrate and drain; "
        "admin: everything",
    )
    token.add_argument("--file", required=True, type=Path, help="the token file (TOML)")
    token.add_argument("--note", default="", help="a note stored with the hash")
    token.set_defaults(handler=_handler("make_token"))
