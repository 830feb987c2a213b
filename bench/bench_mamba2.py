"""Mamba-2, mamba2-130m-shaped: ssmserve's engine vs transformers on CPU, and one snapshot.

Usage (from the repo root)::

    .venv-bench/bin/python bench/bench_mamba2.py [--warmup 5] [--tokens 20] [--batch 64]
        [--batch-steps 10] [--snapshots 5] [--json OUT.json]
    .venv-bench/bin/python bench/bench_mamba2.py --small    # a tiny shape: checks it runs

Needs torch and transformers in ``.venv-bench`` (not project dependencies)::

    .venv-bench/bin/pip install torch==2.13.0 transformers==5.24.0

Without them the script prints one line, writes ``{"skipped": 1, ...}`` and exits 0
(nothing is measured: the figures are a comparison).

What is measured. One model of mamba2-130m's shape (``Architecture.MAMBA2_LM``: hidden
768, 24 layers, state 128, head dim 64, so 24 heads over an inner size of 1536 (expand 2),
1 group, conv 4, vocab 50280, tied embeddings) with the SAME random weights on both
sides: the numpy tensors of ``random_tensors(config, 0)``, given to ``build_model`` and
loaded into ``transformers.Mamba2ForCausalLM`` with ``load_state_dict`` (nothing
unexpected, only the tied ``lm_head.weight`` missing; both asserted). Both are fed the
same token ids from an empty state:

* ssmserve: what the stepper does per tick (``engine.lane``): ``BatchState.stack`` of
  the sessions' states (a copy, ~19.5 MB per session), ``model.step``, ``.session(row)``
  (views); BLAS pinned to 2 threads (``pin_blas_threads``).
* transformers 5.24: its recurrent cache path, ``out = model(input_ids=ids, cache=cache,
  use_cache=True, logits_to_keep=1); cache = out.cache`` (the first call makes the cache
  and runs the prefill path, in the warm-up; later calls the one-token update).
  ``torch.set_num_threads(2)``, eval mode, ``torch.no_grad()``.

Batch 1: one session, wall time per token; ``--warmup`` tokens discarded, then p50 / p99
over ``--tokens``. Batch ``--batch``: that many sessions stepped at once, one warm-up
tick, then tokens/s = batch x ``--batch-steps`` / wall time of those ticks. Agreement:
max abs difference of the logits, ssmserve vs transformers, over the timed batch-1 tokens
and over the last batch tick (with the largest |logit| for scale).

Snapshot (in the ssmserve process, after its timings): the batch-1 session after all its
tokens as a ``Checkpoint`` (state + input history), through the real store on a private
redis-server (``EmbeddedRedis``, AOF on) with the default ``StoreSettings``; the session
is made first with ``Store.create_session``. Medians over ``--snapshots`` snapshots of:
encode (``Checkpoint.encode``: copy + sha256); write (``Store.commit_snapshot``, as a
periodic snapshot: the blob SET in pieces of at most ``piece_bytes`` (4 MiB) in one
pipeline, then the commit script; fewer snapshots than the default retention of 16, so
none is dropped); read (``Store.read_blob``: one MGET of the pieces); decode
(``Checkpoint.decode``: sha256 check + zero-copy views).

Each side runs in its own subprocess (no shared thread pools or allocator).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (
    median_seconds,
    peer_skipped,
    percentiles_ms,
    run_peer_child,
    standard_parser,
    table,
    write_result,
)

from ssmserve.server.engine.config import Architecture, MambaConfig
from ssmserve.server.engine.mamba import MambaModel
from ssmserve.server.engine.presets import preset_config
from ssmserve.server.engine.recurrent_state import SessionState

THREADS = 2
SESSION = "bench-mamba2"
EMBEDDINGS = "backbone.embeddings.weight"
#: Defaults of the counts (``--small``: a few of each, to check the script end to end).
#: transformers' first two one-token updates in a process are slow (~80 and ~30 ms even
#: at the small shape), so keep at least 3 warm-up tokens.
FULL = {"warmup": 5, "tokens": 20, "batch": 64, "batch_steps": 10, "snapshots": 5}
SMALL = {"warmup": 3, "tokens": 5, "batch": 4, "batch_steps": 3, "snapshots": 3}


def mamba2_config(small: bool) -> MambaConfig:
    """mamba2-130m's dims (the ``init-demo --preset mamba2-130m`` config with the
    tokenizer's unpadded vocabulary, 50280), or with ``small`` a tiny model of the same
    kind, to check the script."""
    if not small:
        return dataclasses.replace(preset_config("mamba2-130m"), vocab_size=50280)
    return MambaConfig(
        architecture=Architecture.MAMBA2_LM,
        hidden_size=64,
        state_size=16,
        num_hidden_layers=2,
        intermediate_size=128,
        conv_kernel=4,
        time_step_rank=0,
        use_bias=False,
        use_conv_bias=True,
        layer_norm_epsilon=1e-5,
        vocab_size=100,
        tie_word_embeddings=True,
        num_heads=8,
        head_dim=16,
        n_groups=1,
    )


def token_ids(
    vocab: int, warmup: int, tokens: int, batch: int, steps: int
) -> tuple[np.ndarray, np.ndarray]:
    """The batch-1 ids ``(warmup + tokens,)`` and the batch ids ``(1 + steps, batch)``."""
    rng = np.random.default_rng(0)
    return rng.integers(0, vocab, warmup + tokens), rng.integers(0, vocab, (1 + steps, batch))


# ---------------------------------------------------------------------------- children


def child_ours(args: argparse.Namespace) -> dict[str, Any]:
    from ssmserve.server.engine.demo import random_tensors
    from ssmserve.server.engine.loader import build_model
    from ssmserve.server.engine.numerics import blas_signature, pin_blas_threads
    from ssmserve.server.engine.recurrent_state import BatchState

    threads = pin_blas_threads(THREADS)
    config = mamba2_config(args.small)
    name = "mamba2-small" if args.small else "mamba2-130m-shaped"
    model = build_model(config, random_tensors(config, 0), name=name)
    ids, batch_ids = token_ids(
        config.vocab_size, args.warmup, args.tokens, args.batch, args.batch_steps
    )

    # Batch 1: stack + step + split, as the stepper does for a lone session.
    state = model.new_state()
    samples: list[float] = []
    stack_1: list[float] = []
    logits: list[np.ndarray] = []
    for i, token in enumerate(ids):
        t0 = time.perf_counter()
        stacked = BatchState.stack([state])
        t1 = time.perf_counter()
        batch, out = model.step(stacked, np.array([token]))
        state = batch.session(0)
        elapsed = time.perf_counter() - t0
        if i >= args.warmup:
            samples.append(elapsed)
            stack_1.append(t1 - t0)
            logits.append(np.array(out[0], np.float32))
    np.save(args.out_dir / "ours_b1.npy", np.stack(logits))

    # Batch B: every tick stacks B states (a copy of each), steps, splits into views.
    states = [model.new_state() for _ in range(args.batch)]
    batch, out = model.step(BatchState.stack(states), batch_ids[0])  # warm-up tick
    states = batch.sessions()
    stack_b = 0.0
    t0 = time.perf_counter()
    for row in batch_ids[1:]:
        s0 = time.perf_counter()
        stacked = BatchState.stack(states)
        stack_b += time.perf_counter() - s0
        batch, out = model.step(stacked, row)
        states = batch.sessions()
        del stacked  # (B x 19.5 MB at full size: hold at most one copy of the states)
    batch_s = time.perf_counter() - t0
    np.save(args.out_dir / "ours_bB.npy", np.array(out[: args.batch], np.float32))
    del batch, states

    snapshot = asyncio.run(snapshot_figures(model, state.copy(), ids, args.snapshots))
    return {
        "samples": samples,
        "stack_1_s": statistics.median(stack_1),
        "batch_s": batch_s,
        "stack_b_s": stack_b,
        "blas_threads": threads,
        "blas": blas_signature(),
        "state_bytes": config.state_bytes,
        "snapshot": snapshot,
    }


async def snapshot_figures(
    model: MambaModel, state: SessionState, ids: np.ndarray, repeats: int
) -> dict[str, Any]:
    """Encode, write, read and decode one session's snapshot through the real store."""
    from ssmserve.server.embedded_redis import EmbeddedRedis, EmbeddedRedisSettings
    from ssmserve.server.sessions.config import SessionConfig, SessionDefaults
    from ssmserve.server.state.checkpoint import Checkpoint, CheckpointMeta, InputHistory
    from ssmserve.server.state.lease import SessionLease, new_incarnation
    from ssmserve.server.state.store import Store
    from ssmserve.server.state.store_calls import StoreSettings
    from ssmserve.server.state.store_records import SessionMeta, SnapshotRecord

    step = len(ids)
    ckpt = Checkpoint(
        session_id=SESSION,
        step=step,
        model_id=model.name,
        fingerprint=model.fingerprint,
        state=state,
        history=InputHistory(1, np.asarray(ids, np.int64)),
        meta=CheckpointMeta(reason="periodic"),
    )
    blob = ckpt.encode()
    encode_s = median_seconds(ckpt.encode, repeats)
    decoded = Checkpoint.decode(blob)
    if not decoded.state.bit_equal(state):
        raise RuntimeError("the decoded checkpoint's state differs from the encoded one")
    decode_s = median_seconds(lambda: Checkpoint.decode(blob), repeats)

    # A session with the worker's defaults: keeps 16 snapshots (fewer are written here,
    # so no commit drops one).
    config = SessionConfig().resolve(SessionDefaults(), model.config.output_dim)
    writes: list[float] = []
    reads: list[float] = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        EmbeddedRedis(EmbeddedRedisSettings(data_dir=Path(tmp))) as redis,
    ):
        store = Store(StoreSettings(url=redis.url))
        piece_bytes = store.settings.piece_bytes
        pieces = max(1, -(-len(blob) // piece_bytes))

        def record() -> SnapshotRecord:  # a new id each time, as ``SessionCheckpoints.encode``
            snapshot_id = f"{step:012d}-{time.time_ns() // 1000:014x}-{secrets.token_hex(2)}"
            return SnapshotRecord(snapshot_id, step, "", "periodic", time.time(), len(blob), pieces)

        try:
            lease = SessionLease(SESSION, f"{new_incarnation()}.1", "bench-worker")
            now = time.time()
            meta = SessionMeta(
                SESSION, model.name, model.fingerprint, step, step + 1, config.to_bytes(), now,
                now, False, epoch=1, owner=lease.holder, owner_addr="127.0.0.1:0",
                token=lease.token,
            )  # fmt: skip
            await store.create_session(meta, 600_000, record(), blob, config.max_snapshots)
            for _ in range(repeats):
                rec = record()
                t0 = time.perf_counter()
                await store.commit_snapshot(lease, rec, blob, config.max_snapshots)
                writes.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                got = await store.read_blob(SESSION, rec)
                reads.append(time.perf_counter() - t0)
                if got != blob:
                    raise RuntimeError("the snapshot read back differs from the one written")
        finally:
            await store.aclose()
    return {
        "state_bytes": state.nbytes,
        "blob_bytes": len(blob),
        "piece_bytes": piece_bytes,
        "pieces": pieces,
        "max_snapshots": config.max_snapshots,
        "encode_s": encode_s,
        "write_s": statistics.median(writes),
        "read_s": statistics.median(reads),
        "decode_s": decode_s,
    }


def child_torch(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import transformers
    from transformers import Mamba2Config, Mamba2ForCausalLM

    from ssmserve.server.engine.demo import random_tensors

    torch.set_num_threads(THREADS)
    c = mamba2_config(args.small)
    hf_config = Mamba2Config(
        hidden_size=c.hidden_size,
        num_heads=c.num_heads,
        head_dim=c.head_dim,
        n_groups=c.n_groups,
        state_size=c.state_size,
        num_hidden_layers=c.num_hidden_layers,
        expand=c.intermediate_size // c.hidden_size,
        conv_kernel=c.conv_kernel,
        vocab_size=c.vocab_size,
        tie_word_embeddings=c.tie_word_embeddings,
        use_bias=c.use_bias,
        use_conv_bias=c.use_conv_bias,
        layer_norm_epsilon=c.layer_norm_epsilon,
        time_step_limit=c.time_step_limit,
    )
    model = Mamba2ForCausalLM(hf_config).to(torch.float32).eval()
    tensors = {k: torch.from_numpy(v) for k, v in random_tensors(c, 0).items()}
    result = model.load_state_dict(tensors, strict=False)
    if result.unexpected_keys or set(result.missing_keys) != {"lm_head.weight"}:
        raise RuntimeError(
            f"load_state_dict: missing {result.missing_keys}, unexpected "
            f"{result.unexpected_keys} (expected only the tied lm_head.weight missing)"
        )
    model.tie_weights()
    emb, head = model.backbone.embeddings.weight, model.lm_head.weight
    if emb.data_ptr() != head.data_ptr() or not torch.equal(emb, tensors[EMBEDDINGS]):
        raise RuntimeError("lm_head is not tied to the loaded embeddings")
    ids, batch_ids = token_ids(c.vocab_size, args.warmup, args.tokens, args.batch, args.batch_steps)
    ids_t, batch_t = torch.from_numpy(ids), torch.from_numpy(batch_ids)

    samples: list[float] = []
    logits: list[np.ndarray] = []
    with torch.no_grad():
        cache = None
        for i in range(ids_t.shape[0]):
            t0 = time.perf_counter()
            out = model(
                input_ids=ids_t[None, i : i + 1], cache=cache, use_cache=True, logits_to_keep=1
            )
            cache = out.cache
            elapsed = time.perf_counter() - t0
            if i >= args.warmup:
                samples.append(elapsed)
                logits.append(out.logits[0, -1].numpy().astype(np.float32))
        np.save(args.out_dir / "torch_b1.npy", np.stack(logits))

        out = model(input_ids=batch_t[0, :, None], use_cache=True, logits_to_keep=1)  # warm-up
        cache = out.cache
        t0 = time.perf_counter()
        for row in batch_t[1:]:
            out = model(input_ids=row[:, None], cache=cache, use_cache=True, logits_to_keep=1)
            cache = out.cache
        batch_s = time.perf_counter() - t0
        np.save(args.out_dir / "torch_bB.npy", out.logits[:, -1].numpy().astype(np.float32))
    return {
        "samples": samples,
        "batch_s": batch_s,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def run_child(which: str, args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", which, "--out-dir", str(out_dir)]
    for name in ("warmup", "tokens", "batch", "batch_steps", "snapshots"):
        cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if args.small:
        cmd.append("--small")
    return run_peer_child(cmd)


# ---------------------------------------------------------------------------- parent


def main() -> int:
    parser = standard_parser(__doc__)
    parser.add_argument("--warmup", type=int, help="batch-1 tokens discarded first (5)")
    parser.add_argument("--tokens", type=int, help="batch-1 tokens timed (20)")
    parser.add_argument("--batch", type=int, help="sessions stepped at once (64)")
    parser.add_argument("--batch-steps", type=int, help="batch ticks timed (10)")
    parser.add_argument("--snapshots", type=int, help="snapshots written and read (5)")
    parser.add_argument("--small", action="store_true", help="a tiny shape, few of each")
    parser.add_argument("--child", choices=["ours", "torch"], help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    for name, value in (SMALL if args.small else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)

    if args.child:
        fn = child_ours if args.child == "ours" else child_torch
        print(json.dumps(fn(args)))
        return 0

    missing = [name for name in ("torch", "transformers") if find_spec(name) is None]
    if missing:
        return peer_skipped("bench_mamba2", f"{' and '.join(missing)} not installed", args.json)

    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(tmp)
        ours = run_child("ours", args, out_dir)
        peer = run_child("torch", args, out_dir)
        ours_1, torch_1 = np.load(out_dir / "ours_b1.npy"), np.load(out_dir / "torch_b1.npy")
        ours_b, torch_b = np.load(out_dir / "ours_bB.npy"), np.load(out_dir / "torch_bB.npy")

    o50, o99 = percentiles_ms(ours["samples"])
    t50, t99 = percentiles_ms(peer["samples"])
    ticks = args.batch * args.batch_steps
    o_tps, t_tps = ticks / ours["batch_s"], ticks / peer["batch_s"]
    diff_1 = float(np.abs(ours_1 - torch_1).max())
    diff_b = float(np.abs(ours_b - torch_b).max())
    scale_1, scale_b = float(np.abs(torch_1).max()), float(np.abs(torch_b).max())
    snap = ours["snapshot"]
    c = mamba2_config(args.small)
    shape = (
        f"hidden {c.hidden_size}, {c.num_hidden_layers} layers, state {c.state_size}, "
        f"{c.num_heads} heads of {c.head_dim}, {c.n_groups} group, conv {c.conv_kernel}, "
        f"vocab {c.vocab_size}"
    )

    print(
        f"# Mamba-2, {'--small' if args.small else 'mamba2-130m-shaped'}: {shape}; "
        f"same random weights\n"
        f"ssmserve: numpy engine, {ours['blas']}\n"
        f"torch {peer['torch']}, transformers {peer['transformers']}: "
        f"torch.set_num_threads({THREADS}) -> {peer['threads']} threads\n"
        f"batch 1: {args.warmup} warmup + {args.tokens} timed tokens; batch {args.batch}: "
        f"1 warm-up + {args.batch_steps} timed ticks; load average before: {load[0]:.2f}"
    )
    print(
        table(
            ["what", "ssmserve", "transformers", "ssmserve / transformers"],
            [
                ["batch 1: ms per token, p50", o50, t50, o50 / t50],
                ["batch 1: ms per token, p99", o99, t99, o99 / t99],
                [f"batch {args.batch}: tokens/s", o_tps, t_tps, o_tps / t_tps],
            ],
        )
    )
    print(
        f"ssmserve time in BatchState.stack (copying states in): batch 1 "
        f"{ours['stack_1_s'] * 1e3:.3g} ms per token ({ours['stack_1_s'] * 1e3 / o50:.0%} "
        f"of p50); batch {args.batch} {ours['stack_b_s'] / ours['batch_s']:.0%} of the ticks"
    )
    print(
        f"logits, max |ssmserve - transformers|: batch 1 over {args.tokens} tokens "
        f"{diff_1:.3g} (max |logit| {scale_1:.3g}, relative {diff_1 / scale_1:.2g}); "
        f"batch {args.batch}, last tick {diff_b:.3g} (relative {diff_b / scale_b:.2g})"
    )
    mib = snap["piece_bytes"] / (1 << 20)
    print(
        table(
            ["one session's snapshot (real store, private redis-server)", "value"],
            [
                ["state bytes (model.config.state_bytes)", f"{ours['state_bytes']:,}"],
                ["checkpoint blob bytes (state + input history)", f"{snap['blob_bytes']:,}"],
                [f"pieces in Redis (<= {mib:g} MiB each)", snap["pieces"]],
                ["encode ms (Checkpoint.encode)", snap["encode_s"] * 1e3],
                ["write ms (Store.commit_snapshot: SET pieces + commit)", snap["write_s"] * 1e3],
                ["read ms (Store.read_blob: MGET of the pieces)", snap["read_s"] * 1e3],
                ["decode ms (Checkpoint.decode)", snap["decode_s"] * 1e3],
                ["snapshot total ms (encode + write)", (snap["encode_s"] + snap["write_s"]) * 1e3],
                ["restore total ms (read + decode)", (snap["read_s"] + snap["decode_s"]) * 1e3],
            ],
        )
    )

    if args.json:
        notes = (
            f"{'small shape' if args.small else 'mamba2-130m-shaped'} ({shape}), random "
            f"weights (random_tensors seed 0) shared by both; ssmserve: stack+step+split per "
            f"tick, {ours['blas']}; torch {peer['torch']} transformers "
            f"{peer['transformers']} cache path (cache=, use_cache, logits_to_keep=1), "
            f"{peer['threads']} threads; snapshot medians over {args.snapshots} "
            f"(Store.commit_snapshot / read_blob on an EmbeddedRedis); load average before "
            f"{load[0]:.2f}"
        )
        report: dict[str, object] = {
            "small": int(args.small),
            "ours_p50_ms": o50,
            "ours_p99_ms": o99,
            "torch_p50_ms": t50,
            "torch_p99_ms": t99,
            "ratio_p50": o50 / t50,
            "ratio_p99": o99 / t99,
            "batch": args.batch,
            "ours_batch_tokens_per_s": o_tps,
            "torch_batch_tokens_per_s": t_tps,
            "ratio_batch_tokens_per_s": o_tps / t_tps,
            "ours_stack_ms_batch_1": ours["stack_1_s"] * 1e3,
            "ours_stack_share_batch": ours["stack_b_s"] / ours["batch_s"],
            "max_abs_logit_diff_batch_1": diff_1,
            "max_abs_logit_batch_1": scale_1,
            "max_abs_logit_diff_batch_last_tick": diff_b,
            "max_abs_logit_batch_last_tick": scale_b,
            "state_bytes": ours["state_bytes"],
            "snapshot_blob_bytes": snap["blob_bytes"],
            "snapshot_pieces": snap["pieces"],
            "snapshot_piece_bytes": snap["piece_bytes"],
            "snapshot_encode_ms": snap["encode_s"] * 1e3,
            "snapshot_write_ms": snap["write_s"] * 1e3,
            "snapshot_read_ms": snap["read_s"] * 1e3,
            "snapshot_decode_ms": snap["decode_s"] * 1e3,
            "torch_threads": peer["threads"],
            "blas_threads": ours["blas_threads"],
            "warmup_tokens": args.warmup,
            "timed_tokens": args.tokens,
            "batch_steps": args.batch_steps,
            "load_average_1m": load[0],
            "config": c.canonical(),
            "notes": notes,
        }
        write_result(args.json, report, line=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
