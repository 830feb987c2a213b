"""What the server-side commands of the ``ssmserve`` CLI do (``model``, ``auth``): the
engine and the token file, offline. Their flags are ``ssmserve.server.cli``'s, which
imports this module only when one of them runs (it loads the engine, numba included).

Server errors become the CLI's one-line ``CliError`` here, at the boundary.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import secrets
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from ssmserve.client.atomic_file import atomic_write
from ssmserve.client.cli_errors import CliError
from ssmserve.client.npy_files import load_npy, save_npy
from ssmserve.client.output_files import check_output
from ssmserve.server.api.auth import TENANT_PATTERN, parse_token_file, token_entry, token_hash
from ssmserve.server.engine.bench import (
    BenchResult,
    PrefillBenchResult,
    bench_model,
    bench_prefill,
)
from ssmserve.server.engine.demo import DemoSpec, demo_config, random_tensors
from ssmserve.server.engine.loader import (
    CONFIG_FILE,
    INDEX_FILE,
    WEIGHTS_FILE,
    load_model,
    read_config,
    save_model,
)
from ssmserve.server.engine.model_tensors import expected_shapes
from ssmserve.server.engine.numerics import blas_signature
from ssmserve.server.errors import ModelInputError, SsmserveError
from ssmserve.server.state.checkpoint_bench import bench_checkpoint

_Result = TypeVar("_Result", BenchResult, PrefillBenchResult)


def make_token(args: argparse.Namespace) -> None:
    if not TENANT_PATTERN.fullmatch(args.tenant):
        raise CliError("--tenant must be 1-64 letters, digits, '.', '_' or '-'")
    path: Path = args.file
    check_output(path, "--file")
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


def init_demo(args: argparse.Namespace) -> None:
    directory: Path = args.dir
    existing = [f for f in (CONFIG_FILE, WEIGHTS_FILE, INDEX_FILE) if (directory / f).exists()]
    if existing and not args.force:
        raise CliError(f"{directory} already holds {', '.join(existing)}; pass --force to replace")
    if args.preset is not None:
        _init_preset(directory, args)
        return
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


#: init-demo's shape flags (attribute names): a preset sets every one of them.
_SHAPE_FLAGS = (
    "input_dim",
    "output_dim",
    "hidden",
    "layers",
    "state",
    "arch",
    "head_dim",
    "groups",
)


def _init_preset(directory: Path, args: argparse.Namespace) -> None:
    """``init-demo --preset``: a random-weight language model at a preset's shapes, after
    checking that it fits on the disk and could be loaded here (``presets.check_room``).
    The F32 presets are written whole and loaded back; the BF16 ones (billions of
    parameters) one tensor at a time, their fingerprint hashed as they are written."""
    from ssmserve.server.engine.demo import random_tensor
    from ssmserve.server.engine.loader import save_model_streamed
    from ssmserve.server.engine.machine_memory import available_memory
    from ssmserve.server.engine.presets import (
        PRESET_DTYPES,
        PresetDoesNotFit,
        check_room,
        preset_config,
        preset_needs,
    )

    # A flag left at its default is the engine's ``DemoSpec()`` field (``cli`` writes
    # the same defaults out, checked by tests/test_cli.py).
    defaults = DemoSpec()
    clashes = [f for f in _SHAPE_FLAGS if getattr(args, f) != getattr(defaults, f)]
    if clashes:
        flags = ", ".join("--" + f.replace("_", "-") for f in clashes)
        raise CliError(f"--preset sets every dimension of the model; drop {flags}")
    config, dtype = preset_config(args.preset), PRESET_DTYPES[args.preset]
    try:
        note = check_room(args.preset, str(directory), _free_disk(directory), available_memory())
    except PresetDoesNotFit as exc:
        raise CliError(str(exc)) from None
    if note:
        print(note, file=sys.stderr)
    try:
        if dtype == "F32":
            save_model(directory, config, random_tensors(config, args.seed))
            model_fingerprint = load_model(directory).fingerprint
        else:
            size = preset_needs(args.preset).disk / 1e9
            print(f"writing {args.preset} ({size:.2f} GB, {dtype}) to {directory} ...", flush=True)
            model_fingerprint = save_model_streamed(
                directory,
                config,
                lambda name, shape: random_tensor(config, args.seed, name, shape),
                dtype,
            )
    except OSError as exc:
        raise CliError(f"cannot write {directory}: {exc.strerror or exc}") from None
    print(
        f"wrote {args.preset}-shaped language model (random weights, {dtype}) to {directory} "
        f"(fingerprint {model_fingerprint[:16]})"
    )


def _free_disk(directory: Path) -> int:
    """Bytes free on the filesystem ``directory`` is (or will be) on."""
    here = directory.absolute()
    while not here.exists() and here != here.parent:
        here = here.parent
    return shutil.disk_usage(here).free


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
        **({"mixer_rms_eps": c.mixer_rms_eps} if c.mixer_rms_eps else {}),  # FalconMamba
        **{key: True for key in ("input_normalization", "output_normalization") if getattr(c, key)},
        "input": "token id" if c.is_token_model else f"float32[{c.input_dim}]",
        "output": f"logits[{c.vocab_size}]" if c.is_token_model else f"float32[{c.output_dim}]",
        "parameters": params,
        "weights_bytes": model.weight_bytes,
        "state_bytes_per_session": c.state_bytes,
        "fingerprint": model.fingerprint,
        "blas": blas_signature(),
    }
    return info


def inspect(args: argparse.Namespace) -> None:
    info = describe(args.dir)
    if args.json:
        print(json.dumps(info, indent=2))
        return
    width = max(len(k) for k in info)
    for key, value in info.items():
        shown = f"{value:,}" if isinstance(value, int) else value
        print(f"{key.replace('_', ' '):<{width}}  {shown}")


def load_for_engine(directory: Path, engine: str, quantize: str = "none") -> Any:
    """The model on ``--engine``: ``MambaModel`` (cpu) or ``GpuMambaModel`` (cuda), the
    latter refused in one line where torch / triton are missing or no device runs it.
    ``quantize``: ``--quantize`` (Q8_0 on the cpu engine only)."""
    if engine != "cuda":
        return load_model(directory, quantize=quantize)
    if quantize != "none":
        raise CliError(f"--quantize {quantize} runs on the cpu engine only; drop --engine cuda")
    from ssmserve.server.engine.gpu.runtime import INSTALL_HINT, missing_packages

    missing = missing_packages()
    if missing:
        raise CliError(f"--engine cuda needs {' and '.join(missing)}: {INSTALL_HINT}")
    from ssmserve.server.engine.gpu.model import GpuMambaModel

    try:
        return GpuMambaModel.load(directory)
    except RuntimeError as exc:  # no CUDA device and no interpreter
        raise CliError(f"--engine cuda: {exc}") from None


def run(args: argparse.Namespace) -> None:
    inputs = load_npy(args.input)
    check_output(args.output)  # before the model runs: its work is not thrown away
    model = load_for_engine(args.dir, args.engine, args.quantize)
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
        outputs, _ = model.prefill(inputs) if args.prefill else model.run(inputs)
    except ModelInputError as exc:
        raise ModelInputError(f"{args.input}: {exc}") from None
    save_npy(args.output, outputs)
    print(f"wrote {outputs.shape[0]} steps of {outputs.shape[1]} outputs to {args.output}")


def bench(args: argparse.Namespace) -> None:
    if args.checkpoint:
        bench_a_checkpoint(args)
        return
    if args.prefill is not None:
        bench_a_prefill(args)
        return
    model = load_for_engine(args.dir, args.engine, args.quantize)
    result = _engine_numerics(bench_model(model, args.batch, args.steps, args.warmup), model)
    if args.json:
        print(json.dumps(result.as_dict()))
        return
    c = model.config
    print(
        f"model       {args.dir} ({c.architecture}, hidden {c.hidden_size}, "
        f"{c.num_hidden_layers} layers, state {c.state_size})\n"
        f"weights     {weights_held(model)}\n"
        f"batch       {result.batch} sessions, {result.steps} timed steps "
        f"after {result.warmup} warm-up\n"
        f"step        median {result.step_us_median:,.1f} us   p10 {result.step_us_p10:,.1f} us"
        f"   p90 {result.step_us_p90:,.1f} us\n"
        f"throughput  {result.steps_per_s:,.0f} session-steps/s (batch / median step)\n"
        f"numerics    {result.numerics} (engine alone: no gRPC, no Redis)"
    )


def bench_a_prefill(args: argparse.Namespace) -> None:
    if args.batch != 1:
        raise ModelInputError("--prefill times one session: leave out --batch")
    model = load_for_engine(args.dir, args.engine, args.quantize)
    result = bench_prefill(model, args.prefill, args.rounds, args.steps, args.warmup)
    result = _engine_numerics(result, model)
    if args.json:
        print(json.dumps(result.as_dict()))
        return
    print(
        f"model        {args.dir} ({model.config.architecture}, "
        f"hidden {model.config.hidden_size}, {model.config.num_hidden_layers} layers)\n"
        f"weights      {weights_held(model)}\n"
        f"prefill      {result.prefill_steps} inputs, last outputs: median "
        f"{result.prefill_ms:,.1f} ms (min {result.prefill_ms_min:,.1f}) over {result.rounds}"
        f" rounds, {result.prefill_us_per_input:,.1f} us an input\n"
        f"decode step  median {result.step_us_median:,.1f} us   p10 {result.step_us_p10:,.1f} us"
        f"   p90 {result.step_us_p90:,.1f} us (one session, {result.steps} steps)\n"
        f"ratio        {result.prefill_per_input_over_step:.3f} (prefill per input / decode step)"
        f"\nnumerics     {result.numerics} (engine alone: no gRPC, no Redis)"
    )


def weights_held(model: Any) -> str:
    """How the products' weights are held and their bytes: ``bf16 + f32, 312.4 MiB``."""
    linears = getattr(model, "linears", None)
    if linears is None:  # the GPU engine
        return "on the device"
    formats = sorted({lin.format for lin in linears}, key=("q8_0", "bf16", "f16", "f32").index)
    return f"{' + '.join(formats)}, {model.weight_bytes / 2**20:,.1f} MiB"


def _engine_numerics(result: _Result, model: Any) -> _Result:
    """``result`` with the numerics signature of the engine that ran it (the GPU engine
    has its own; ``bench`` fills in the CPU engine's)."""
    signature = getattr(model, "numerics_signature", None)
    return result if signature is None else dataclasses.replace(result, numerics=signature)


def bench_a_checkpoint(args: argparse.Namespace) -> None:
    result = bench_checkpoint(read_config(args.dir), args.dir.resolve().name)
    if args.json:
        print(json.dumps(result.as_dict()))
        return
    print(
        f"state       {result.state_bytes:,} bytes ({result.state_bytes / 2**20:.2f} MiB), "
        f"checkpoint format {result.format_version}: {result.blob_bytes:,} bytes\n"
        f"encode      {result.encode_ms:.3f} ms ({result.encode_over_memcpy:.2f}x memcpy)\n"
        f"decode      {result.decode_ms:.3f} ms ({result.decode_over_memcpy:.2f}x memcpy)\n"
        f"memcpy      {result.memcpy_ms:.3f} ms (the state's bytes into a new buffer)\n"
        f"format 1    encode {result.format1_encode_ms:.3f} ms, decode "
        f"{result.format1_decode_ms:.3f} ms (sha256)\n"
        f"medians of {result.rounds} rounds each, this run"
    )


def offline(command: Callable[[argparse.Namespace], None], args: argparse.Namespace) -> None:
    """Run ``command``; the server's typed errors as the CLI's one-line CliError."""
    try:
        command(args)
    except SsmserveError as exc:
        raise CliError(str(exc)) from None
