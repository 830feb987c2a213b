"""Mamba-2, mamba2-130m-shaped: ssmserve's engine vs transformers on CPU, and snapshots.

Usage (from the repo root)::

    .venv-bench/bin/python bench/bench_mamba2.py [--tokens 20] [--batch 64] [--json OUT]
    .venv-bench/bin/python bench/bench_mamba2.py --small      # a tiny shape, to check it runs

Needs torch and transformers in ``.venv-bench`` (``bench/run`` installs them); without
them the transformers column says "skipped" and the rest still runs.

The model: hidden 768, 24 layers, state 128, head dim 64 (24 heads), 1 group, expand 2,
conv 4, vocab 50280, tied embeddings (``Mamba2ForCausalLM``), random weights
(``random_tensors(config, 0)``) written once to a model directory that both sides load:
ssmserve with ``load_model``, transformers with a strict ``load_state_dict`` of the same
tensors. Each side runs in its own subprocess (no shared thread pools), 2 threads each
(``pin_blas_threads`` / ``torch.set_num_threads(2)``), fed the same token ids one at a time:

* **batch 1**: wall time per token (after 3 warm-up tokens), p50 and p99;
* **batch ``--batch``**: tokens per second over ``--tokens // 2`` steps of that many
  sessions at once (ssmserve: one ``model.step`` of the stacked states, as the stepper
  does; transformers: one forward of ``--batch`` rows through its cache);
* agreement: max abs difference of the batch-1 logits, ours vs transformers.

Then, in the parent: the state bytes of one session, and a snapshot of it through the
real store on a private redis-server: encode (``Checkpoint.encode``), write
(``Store.commit_snapshot``: the blob SET in pieces of at most 4 MiB, then the commit
script), read (``Store.read_blob``, one MGET of the pieces) and decode.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.util import find_spec
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import median_seconds, table

from ssmserve.server.engine.config import Architecture, MambaConfig
from ssmserve.server.engine.demo import random_tensors
from ssmserve.server.engine.loader import save_model

THREADS = 2


def mamba2_config(small: bool) -> MambaConfig:
    d, layers, n, p, vocab = (64, 2, 16, 16, 100) if small else (768, 24, 128, 64, 50280)
    return MambaConfig(
        architecture=Architecture.MAMBA2_LM,
        hidden_size=d,
        state_size=n,
        num_hidden_layers=layers,
        intermediate_size=2 * d,
        conv_kernel=4,
        time_step_rank=0,
        use_bias=False,
        use_conv_bias=True,
        layer_norm_epsilon=1e-5,
        vocab_size=vocab,
        tie_word_embeddings=True,
        num_heads=2 * d // p,
        head_dim=p,
        n_groups=1,
    )


# ---------------------------------------------------------------------- one side each


def run_ssmserve(model_dir: str, ids: np.ndarray, batch: int, steps: int) -> dict:
    from ssmserve.server.engine.loader import load_model
    from ssmserve.server.engine.numerics import pin_blas_threads
    from ssmserve.server.engine.recurrent_state import BatchState

    pin_blas_threads(THREADS)
    model = load_model(model_dir)
    state = BatchState.stack([model.new_state()])
    per_token, logits = [], []
    for t, token in enumerate(ids):
        started = time.perf_counter()
        state, out = model.step(state, np.asarray([token]))
        per_token.append(time.perf_counter() - started)
        logits.append(out[0].copy())
        del t
    states = BatchState.stack([model.new_state()] * batch)
    row = ids[:batch] if len(ids) >= batch else np.resize(ids, batch)
    states, _ = model.step(states, row)  # warm-up at this batch size
    started = time.perf_counter()
    for _ in range(steps):
        states, _ = model.step(states, row)
    elapsed = time.perf_counter() - started
    return {"per_token": per_token, "logits": np.stack(logits), "batch_s": elapsed}


def run_transformers(model_dir: str, ids: np.ndarray, batch: int, steps: int) -> dict:
    import torch
    from safetensors.numpy import load_file
    from transformers import Mamba2Config, Mamba2ForCausalLM

    torch.set_num_threads(THREADS)
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    config = Mamba2Config(**{k: v for k, v in raw.items() if k != "architectures"})
    model = Mamba2ForCausalLM(config).to(torch.float32).eval()
    tensors = {
        k: torch.from_numpy(v) for k, v in load_file(f"{model_dir}/model.safetensors").items()
    }
    result = model.load_state_dict(tensors, strict=False)
    assert not result.unexpected_keys, result.unexpected_keys
    assert set(result.missing_keys) <= {"lm_head.weight"}, result.missing_keys
    model.tie_weights()
    assert torch.equal(model.lm_head.weight, tensors["backbone.embeddings.weight"])
    per_token, logits = [], []
    with torch.no_grad():
        cache = None
        for token in ids:
            started = time.perf_counter()
            out = model(
                input_ids=torch.tensor([[int(token)]]), cache=cache, use_cache=True,
                logits_to_keep=1,
            )  # fmt: skip
            cache = out.cache
            per_token.append(time.perf_counter() - started)
            logits.append(out.logits[0, -1].float().numpy().copy())
        row = ids[:batch] if len(ids) >= batch else np.resize(ids, batch)
        tokens = torch.tensor(row[:, None])
        out = model(input_ids=tokens, use_cache=True, logits_to_keep=1)  # prefill: warm-up
        cache = out.cache
        started = time.perf_counter()
        for _ in range(steps):
            out = model(input_ids=tokens, cache=cache, use_cache=True, logits_to_keep=1)
            cache = out.cache
        elapsed = time.perf_counter() - started
    return {"per_token": per_token, "logits": np.stack(logits), "batch_s": elapsed}


def side(name: str, model_dir: str, ids: np.ndarray, batch: int, steps: int) -> dict | None:
    """Run one side in its own process; None when it cannot run here (no torch)."""
    if name == "transformers" and not (find_spec("torch") and find_spec("transformers")):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.npz"
        np.save(Path(tmp) / "ids.npy", ids)
        code = (
            "import sys, numpy as np; sys.path.insert(0, sys.argv[1]);"
            "import bench_mamba2 as b;"
            f"r = b.run_{name}(sys.argv[2], np.load(sys.argv[3]), int(sys.argv[4]),"
            " int(sys.argv[5]));"
            "np.savez(sys.argv[6], per_token=r['per_token'], logits=r['logits'],"
            " batch_s=r['batch_s'])"
        )
        env = {**os.environ, "OMP_NUM_THREADS": str(THREADS)}
        subprocess.run(
            [sys.executable, "-c", code, str(Path(__file__).parent), model_dir,
             str(Path(tmp) / "ids.npy"), str(batch), str(steps), str(out)],
            check=True, env=env, timeout=3600,
        )  # fmt: skip
        got = np.load(out)
        return {k: got[k] for k in got.files}


# ---------------------------------------------------------------------- snapshots


async def snapshot_timings(model_dir: str, repeats: int) -> dict:
    from ssmserve.server.embedded_redis import EmbeddedRedis, EmbeddedRedisSettings
    from ssmserve.server.engine.loader import load_model
    from ssmserve.server.state.checkpoint import Checkpoint, InputHistory
    from ssmserve.server.state.lease import SessionLease
    from ssmserve.server.state.store import SessionMeta, SnapshotRecord, Store, StoreSettings

    model = load_model(model_dir)
    ids = np.random.default_rng(1).integers(0, model.config.vocab_size, 8)
    _, state = model.run(ids)
    ckpt = Checkpoint("bench", 8, model.name, model.fingerprint, state, InputHistory(1, ids))
    blob = ckpt.encode()
    with (
        tempfile.TemporaryDirectory() as tmp,
        EmbeddedRedis(EmbeddedRedisSettings(data_dir=Path(tmp))) as redis,
    ):
        store = Store(StoreSettings(url=redis.url, socket_timeout_s=30.0))
        try:
            piece = store.settings.piece_bytes
            pieces = -(-len(blob) // piece)

            def record(i: int) -> SnapshotRecord:
                return SnapshotRecord(f"{8 + i:012d}-b", 8, "", "bench", 1.0, len(blob), pieces)

            token = "0123456789abcdef0123456789abcdef.1"
            meta = SessionMeta(
                "bench", model.name, model.fingerprint, 8, 9, b"cfg", 1.0, 1.0, False, 1,
                "w1", "addr:1", token, "n" * 16,
            )  # fmt: skip
            await store.create_session(meta, 600_000, record(0), blob, 4)
            lease = SessionLease("bench", token, "w1")
            writes, reads = [], []
            for i in range(1, repeats + 1):
                started = time.perf_counter()
                await store.commit_snapshot(lease, record(i), blob, 4)
                writes.append(time.perf_counter() - started)
                started = time.perf_counter()
                assert await store.read_blob("bench", record(i)) == blob
                reads.append(time.perf_counter() - started)
        finally:
            await store.aclose()
    return {
        "state_bytes": state.nbytes,
        "blob_bytes": len(blob),
        "pieces": pieces,
        "encode_s": median_seconds(ckpt.encode, repeats),
        "decode_s": median_seconds(lambda: Checkpoint.decode(blob), repeats),
        "write_s": statistics.median(writes),
        "read_s": statistics.median(reads),
    }


# ---------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=20, help="batch-1 tokens timed")
    parser.add_argument("--batch", type=int, default=64, help="sessions stepped at once")
    parser.add_argument("--small", action="store_true", help="a tiny shape, to check it runs")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    config = mamba2_config(args.small)
    warm = 3
    ids = np.random.default_rng(0).integers(0, config.vocab_size, warm + args.tokens)
    steps = max(2, args.tokens // 2)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(Path(tmp) / "mamba2-130m-shaped")
        save_model(model_dir, config, random_tensors(config, 0))
        ours = side("ssmserve", model_dir, ids, args.batch, steps)
        theirs = side("transformers", model_dir, ids, args.batch, steps)
        snap = asyncio.run(snapshot_timings(model_dir, repeats=5))
    assert ours is not None

    def p(result: dict | None, q: float) -> float | str:
        if result is None:
            return "skipped"
        return float(np.quantile(result["per_token"][warm:], q)) * 1e3

    def rate(result: dict | None) -> float | str:
        return "skipped" if result is None else args.batch * steps / float(result["batch_s"])

    def ratio(a: float | str, b: float | str) -> float | str:
        return a / b if isinstance(a, float) and isinstance(b, float) else "-"

    rows = []
    for label, ours_v, theirs_v in (
        ("batch 1: ms per token, p50", p(ours, 0.5), p(theirs, 0.5)),
        ("batch 1: ms per token, p99", p(ours, 0.99), p(theirs, 0.99)),
        (f"batch {args.batch}: tokens/s", rate(ours), rate(theirs)),
    ):
        rows.append([label, ours_v, theirs_v, ratio(ours_v, theirs_v)])
    agreement = (
        "skipped"
        if theirs is None
        else float(np.abs(ours["logits"][warm:] - theirs["logits"][warm:]).max())
    )
    c = config
    print(
        f"# Mamba-2 {'(small) ' if args.small else ''}hidden {c.hidden_size}, "
        f"{c.num_hidden_layers} layers, state {c.state_size}, {c.num_heads} heads of "
        f"{c.head_dim}, {c.n_groups} group, vocab {c.vocab_size}; {THREADS} threads each"
    )
    print(table(["", "ssmserve", "transformers", "ssmserve / transformers"], rows))
    print(f"max |logits difference| at batch 1: {agreement}")
    print()
    print(
        table(
            ["one session's snapshot", "value"],
            [
                ["state bytes", f"{snap['state_bytes']:,}"],
                ["checkpoint bytes", f"{snap['blob_bytes']:,}"],
                ["pieces in Redis (<= 4 MiB each)", snap["pieces"]],
                ["encode, ms", snap["encode_s"] * 1e3],
                ["write to Redis (pieces + commit), ms", snap["write_s"] * 1e3],
                ["read from Redis, ms", snap["read_s"] * 1e3],
                ["decode, ms", snap["decode_s"] * 1e3],
            ],
        )
    )
    if args.json:
        figures = {
            "rows": rows,
            "agreement": agreement,
            "snapshot": snap,
            "config": c.canonical(),
        }
        args.json.write_text(json.dumps(figures, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
