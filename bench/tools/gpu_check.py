"""The GPU engine's device check, in one go: fidelity, exactness, speed (issue 43 part 5).

Usage (from the repo root, on a machine with a GPU and ``pip install -e '.[cuda]'``)::

    .venv/bin/python bench/tools/gpu_check.py [--models mamba-130m,mamba2-130m] [--json OUT]
    .venv/bin/python bench/tools/gpu_check.py --smoke    # CPU, Triton's interpreter, tiny models

For each model (random weights at the preset's shapes, ``engine/presets.py``, written to a
temp dir as ``ssmserve model init-demo --preset`` does):

* **fidelity**: 16 tokens stepped by the GPU engine, the CPU engine (``MambaModel``), the
  plain PyTorch step (``gpu_reference.PlainStep``) and transformers' ``*ForCausalLM``
  where installed; max abs logit difference over max abs logit, each against the CPU
  engine (goal: <= 1e-4);
* **exactness** (bit for bit, on the device): a step of 256 sessions from random states,
  then every batch size 1..256 (the first b of them) and a permutation, each row's logits
  and state; prefill over T in {1, 2, 7, 17, 64, 512} against T steps (every logit, the
  state); the state after 7 steps through a checkpoint (numpy, encoded, decoded)
  continuing by prefill; the engine's step replayed as a CUDA graph against the eager step;
* **speed**: batch-1 decode ms/token and batch-64 tokens/s of the engine (eager and
  replayed as a CUDA graph), of the plain PyTorch step (eager and graph) and of
  transformers; a 512-token prompt's prefill (last logits) against stepping it; the goals
  of issue 43 part 4 as booleans.

Prints a table per model and one JSON object on its last line; exit status 0 when every
fidelity and exactness check passes (speed goals are reported, not enforced). Sized to
finish within 8 minutes on an H100 (most of it Triton's first compiles and transformers).
``--smoke``: CPU, ``TRITON_INTERPRET=1``, a tiny Mamba-1 and Mamba-2 LM, small sizes (what
``tests/test_gpu_check.py`` runs).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench" / "tools"))


@dataclass(frozen=True)
class Plan:
    batch_sizes: list[int]
    prefill_lengths: list[int]
    fidelity_tokens: int
    decode_calls: int
    big_batch: int
    prompt: int
    transformers: bool


FULL = Plan(list(range(1, 257)), [1, 2, 7, 17, 64, 512], 16, 50, 64, 512, True)
SMOKE = Plan([1, 2, 3, 4], [1, 2, 9], 4, 2, 4, 9, False)


def smoke_configs() -> dict[str, Any]:
    from ssmserve.server.engine.config import Architecture, MambaConfig

    common = {
        "hidden_size": 16, "state_size": 4, "num_hidden_layers": 1, "intermediate_size": 32,
        "conv_kernel": 3, "use_bias": False, "use_conv_bias": True, "layer_norm_epsilon": 1e-5,
        "vocab_size": 29, "tie_word_embeddings": True,
    }  # fmt: skip
    return {
        "tiny-mamba": MambaConfig(architecture=Architecture.LM, time_step_rank=1, **common),
        "tiny-mamba2": MambaConfig(
            architecture=Architecture.MAMBA2_LM,
            time_step_rank=0,
            num_heads=4,
            head_dim=8,
            n_groups=2,
            **common,
        ),
    }


def rel(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def check_model(directory: Path, plan: Plan, device: Any) -> dict[str, Any]:
    import torch
    from gpu_reference import (
        PlainStep,
        graphed,
        time_per_call,
        transformers_logits,
        transformers_model,
    )

    from ssmserve.server.engine.gpu.model import DeviceBatch, GpuMambaModel
    from ssmserve.server.engine.loader import load_model, read_config, read_weights
    from ssmserve.server.engine.recurrent_state import BatchState, SessionState
    from ssmserve.server.state.checkpoint import Checkpoint, InputHistory

    config = read_config(directory)
    gpu = GpuMambaModel.load(directory, device=device)
    cpu = load_model(directory)
    plain = PlainStep(config, read_weights(directory, config), device)
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {"numerics": gpu.numerics, "numerics_signature": gpu.numerics_signature}

    # ---- fidelity
    ids = rng.integers(0, config.vocab_size, plan.fidelity_tokens)
    ours, _ = gpu.run(ids)
    theirs, _ = cpu.run(ids)
    conv, ssm = plain.new_states(1)
    with torch.no_grad():
        plain_rows = [
            plain(torch.from_numpy(ids[t : t + 1]).to(device), conv, ssm) for t in range(len(ids))
        ]
    fidelity: dict[str, Any] = {
        "tokens": len(ids),
        "gpu_vs_cpu_engine": rel(ours, theirs),
        "plain_torch_vs_cpu_engine": rel(torch.cat(plain_rows).cpu().numpy(), theirs),
    }
    hf = None
    if plan.transformers:
        try:
            hf = transformers_model(directory, device)
            hf_logits, _ = transformers_logits(hf, ids[None, :], device)
            fidelity["transformers_vs_cpu_engine"] = rel(hf_logits[0], theirs)
            fidelity["gpu_vs_transformers"] = rel(ours, hf_logits[0])
        except Exception as exc:  # not installed, or a version that cannot load it
            fidelity["transformers"] = f"skipped: {type(exc).__name__}: {str(exc)[:200]}"
    fidelity["ok"] = (
        fidelity["gpu_vs_cpu_engine"] <= 1e-4 and fidelity.get("gpu_vs_transformers", 0) <= 1e-4
    )
    out["fidelity"] = fidelity
    print(f"  fidelity {fidelity}", flush=True)  # each part as it ends: a cut run keeps it

    # ---- exactness: batch sizes and positions
    big = max(plan.batch_sizes)
    gen = torch.Generator(device="cpu").manual_seed(1)
    zero = BatchState.stack([gpu.new_state()])

    def random_batch(b: int) -> DeviceBatch:
        def rand(a: np.ndarray) -> torch.Tensor:
            return (torch.randn((b, *a.shape[1:]), generator=gen) * 0.5).to(device)

        return DeviceBatch(tuple(rand(a) for a in zero.conv), tuple(rand(a) for a in zero.ssm))

    batch = random_batch(big)
    tokens = torch.from_numpy(rng.integers(0, config.vocab_size, big)).to(device)
    full, logits = gpu.step_device(batch, tokens)
    bad_sizes = []
    for b in plan.batch_sizes:
        part, part_logits = gpu.step_device(
            DeviceBatch(tuple(c[:b] for c in batch.conv), tuple(s[:b] for s in batch.ssm)),
            tokens[:b],
        )
        same = torch.equal(part_logits, logits[:b]) and all(
            torch.equal(x, y[:b])
            for x, y in zip(part.conv + part.ssm, full.conv + full.ssm, strict=True)
        )
        if not same:
            bad_sizes.append(b)
    perm = torch.randperm(big, generator=gen).to(device)
    mixed, mixed_logits = gpu.step_device(
        DeviceBatch(tuple(c[perm] for c in batch.conv), tuple(s[perm] for s in batch.ssm)),
        tokens[perm],
    )
    perm_ok = torch.equal(mixed_logits, logits[perm]) and all(
        torch.equal(x, y[perm])
        for x, y in zip(mixed.conv + mixed.ssm, full.conv + full.ssm, strict=True)
    )

    # ---- exactness: prefill == steps, checkpoint continuation
    longest = max(plan.prefill_lengths)
    prompt = rng.integers(0, config.vocab_size, longest)
    layout = gpu.new_state().layout
    start = SessionState.of_buffer(
        (rng.standard_normal(layout.size) * 0.5).astype(np.float32), layout
    )
    one = DeviceBatch.from_host(BatchState.stack([start]), device)
    stepped, after = [], {}
    prompt_dev = torch.from_numpy(prompt).to(device)
    resume = min(7, longest - 1)
    for t in range(longest):
        one, row = gpu.step_device(one, prompt_dev[t : t + 1])
        stepped.append(row)
        if t + 1 in plan.prefill_lengths or t + 1 == resume:
            after[t + 1] = one.to_host().session(0).copy()
    stepped_logits = torch.cat(stepped).cpu().numpy()
    bad_lengths = []
    for length in plan.prefill_lengths:
        p_logits, p_state = gpu.prefill(prompt[:length], start)
        if p_logits.tobytes() != stepped_logits[:length].tobytes() or not p_state.bit_equal(
            after[length]
        ):
            bad_lengths.append(length)
    ckpt = Checkpoint(
        session_id="check", step=resume, model_id=gpu.name, fingerprint=gpu.fingerprint,
        state=after[resume], history=InputHistory(1, prompt[:resume]),
    )  # fmt: skip
    restored = Checkpoint.decode(ckpt.encode())
    restored.check_model(gpu)  # type: ignore[arg-type]
    c_logits, c_state = gpu.prefill(prompt[resume:], restored.state)
    resumed_ok = c_logits.tobytes() == stepped_logits[resume:].tobytes() and c_state.bit_equal(
        after[longest]
    )
    # ---- exactness: the served step (``GpuMambaModel.step``: host states in and out, the
    # batch run in its size bucket's CUDA graph, ``graphs.py``) against the eager step
    bucket_sizes_differing = []
    host = full.to_host()
    for b in sorted({1, 3, 8, 37, min(big, 64), big}):
        if b > big:
            continue
        served, served_logits = gpu.step(
            BatchState(tuple(c[:b] for c in host.conv), tuple(s[:b] for s in host.ssm)),
            tokens[:b].cpu().numpy(),
        )
        eager, eager_logits = gpu.step_device(
            DeviceBatch(tuple(c[:b] for c in full.conv), tuple(s[:b] for s in full.ssm)),
            tokens[:b],
        )
        eager_host = eager.to_host()
        same = served_logits.tobytes() == eager_logits.cpu().numpy().tobytes() and all(
            np.array_equal(x.view(np.uint32), y.view(np.uint32))
            for x, y in zip(served.conv + served.ssm, eager_host.conv + eager_host.ssm, strict=True)
        )
        if not same:
            bucket_sizes_differing.append(b)
    exact: dict[str, Any] = {
        "served_step_sizes_differing": bucket_sizes_differing,
        "batch_sizes": [min(plan.batch_sizes), big],
        "batch_sizes_differing": bad_sizes,
        "permutation_equal": perm_ok,
        "prefill_lengths": plan.prefill_lengths,
        "prefill_lengths_differing": bad_lengths,
        "checkpoint_continues": resumed_ok,
    }

    print(f"  exact {exact}", flush=True)

    # ---- speed
    on_gpu = torch.device(device).type == "cuda"
    b1, ids1 = random_batch(1), tokens[:1]
    bb, idsb = random_batch(plan.big_batch), tokens[: plan.big_batch]
    calls = plan.decode_calls
    speed: dict[str, Any] = {"big_batch": plan.big_batch, "prompt": plan.prompt}
    with torch.no_grad():
        speed["engine_b1_ms"] = 1e3 * time_per_call(
            lambda: gpu.step_device(b1, ids1), calls, device
        )
        speed["engine_big_tok_s"] = plan.big_batch / time_per_call(
            lambda: gpu.step_device(bb, idsb), calls, device
        )
        conv1, ssm1 = plain.new_states(1)
        convb, ssmb = plain.new_states(plan.big_batch)
        speed["plain_b1_ms"] = 1e3 * time_per_call(lambda: plain(ids1, conv1, ssm1), calls, device)
        speed["plain_big_tok_s"] = plan.big_batch / time_per_call(
            lambda: plain(idsb, convb, ssmb), calls, device
        )
        if on_gpu:
            eager_state, eager_logits = gpu.step_device(b1, ids1)
            holder: dict[str, Any] = {}

            def engine_step() -> None:
                holder["out"] = gpu.step_device(b1, ids1)

            replay = graphed(engine_step, device)
            replay()
            torch.cuda.synchronize()
            g_state, g_logits = holder["out"]
            exact["cuda_graph_equals_eager"] = torch.equal(g_logits, eager_logits) and all(
                torch.equal(x, y)
                for x, y in zip(
                    g_state.conv + g_state.ssm, eager_state.conv + eager_state.ssm, strict=True
                )
            )
            speed["engine_b1_graph_ms"] = 1e3 * time_per_call(replay, calls, device)
            replay_big = graphed(lambda: gpu.step_device(bb, idsb), device)
            speed["engine_big_graph_tok_s"] = plan.big_batch / time_per_call(
                replay_big, calls, device
            )
            speed["plain_b1_graph_ms"] = 1e3 * time_per_call(
                graphed(lambda: plain(ids1, conv1, ssm1), device), calls, device
            )
            speed["plain_big_graph_tok_s"] = plan.big_batch / time_per_call(
                graphed(lambda: plain(idsb, convb, ssmb), device), calls, device
            )
    long_prompt = rng.integers(0, config.vocab_size, plan.prompt)
    speed["prefill_ms"] = 1e3 * time_per_call(
        lambda: gpu.prefill(long_prompt, outputs="last"), 3, device, warmup=1
    )
    # What a worker's step costs: host states in and out, the bucket's graph replayed.
    host_b1 = b1.to_host()
    ids1_host = ids1.cpu().numpy()
    speed["served_b1_ms"] = 1e3 * time_per_call(lambda: gpu.step(host_b1, ids1_host), calls, device)
    step_ms = speed.get("engine_b1_graph_ms", speed["engine_b1_ms"])
    speed["stepping_prompt_ms"] = plan.prompt * step_ms
    speed["prefill_speedup"] = speed["stepping_prompt_ms"] / speed["prefill_ms"]
    if hf is not None:
        _, seconds = transformers_logits(hf, rng.integers(0, config.vocab_size, (1, 9)), device)
        speed["transformers_b1_ms"] = 1e3 * seconds
        _, seconds = transformers_logits(
            hf, rng.integers(0, config.vocab_size, (plan.big_batch, 5)), device
        )
        speed["transformers_big_tok_s"] = plan.big_batch / seconds
    speed["goals"] = {
        "b1_within_1.2x_plain_graph": step_ms <= 1.2 * speed.get("plain_b1_graph_ms", float("nan")),
        "b1_10x_transformers": "transformers_b1_ms" in speed
        and 10 * step_ms <= speed["transformers_b1_ms"],
        "big_15k_tok_s": speed.get("engine_big_graph_tok_s", speed["engine_big_tok_s"]) >= 15_000,
        "prompt_20x_stepping": speed["prefill_speedup"] >= 20,
    }
    exact["ok"] = (
        not bad_sizes and perm_ok and not bad_lengths and resumed_ok
        and not bucket_sizes_differing and exact.get("cuda_graph_equals_eager", True)
    )  # fmt: skip
    out.update(exact=exact, speed=speed)
    return out


def write_model(directory: Path, config: Any, seed: int = 0) -> None:
    from ssmserve.server.engine.demo import random_tensors
    from ssmserve.server.engine.loader import save_model

    save_model(directory, config, random_tensors(config, seed))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--models", default="mamba-130m,mamba2-130m", help="presets, comma-separated"
    )
    parser.add_argument(
        "--smoke", action="store_true", help="CPU, Triton's interpreter, tiny models"
    )
    parser.add_argument("--json", type=Path, help="also write the JSON object here")
    args = parser.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch
    import triton

    from ssmserve.server.engine.gpu.runtime import device_name
    from ssmserve.server.engine.presets import preset_config

    started = time.perf_counter()
    if args.smoke:
        device, plan, configs = torch.device("cpu"), SMOKE, smoke_configs()
    else:
        if not torch.cuda.is_available():
            print(
                "gpu_check: no CUDA device (use --smoke for the CPU interpreter run)",
                file=sys.stderr,
            )
            return 2
        device, plan = torch.device("cuda"), FULL
        configs = {name: preset_config(name) for name in args.models.split(",")}
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        for name, config in configs.items():
            directory = Path(tmp) / name
            write_model(directory, config)
            t0 = time.perf_counter()
            print(f"{name}:", flush=True)
            try:
                results[name] = check_model(directory, plan, device)
                print(f"  speed {results[name]['speed']}", flush=True)
            except Exception as exc:  # one model's failure still reports the other's
                traceback.print_exc()
                results[name] = {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}
            results[name]["seconds"] = round(time.perf_counter() - t0, 1)
    ok = all(
        "error" not in r and r["fidelity"]["ok"] and r["exact"]["ok"] for r in results.values()
    )
    summary = {
        "check": "gpu_check",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "device": device_name(device),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "smoke": args.smoke,
        "ok": ok,
        "elapsed_s": round(time.perf_counter() - started, 1),
        "models": results,
    }
    text = json.dumps(summary, default=float)
    if args.json is not None:
        args.json.write_text(text + "\n")
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
