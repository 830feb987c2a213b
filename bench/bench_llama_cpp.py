"""ssmserve's engine beside llama.cpp on CPU: the same Mamba model, the same tokens.

Usage (from the repo root)::

    .venv/bin/python bench/tools/make_mamba_130m.py MODEL_DIR [--arch mamba2]
    PEER/bin/python CONVERT_HF_TO_GGUF MODEL_DIR --outtype f32 --outfile MODEL.gguf
    .venv/bin/python bench/bench_llama_cpp.py --model MODEL_DIR --gguf MODEL.gguf
        [--peer-python PEER/bin/python] [--converter CONVERT_HF_TO_GGUF]
        [--arch mamba|mamba2] [--prompt 512] [--rounds 5] [--steps 10] [--saves 5]
        [--batch 8] [--batch-steps 5] [--check-steps 4] [--json OUT.json]

(The first two lines are done by the script when MODEL_DIR has no model, ``--arch``'s
being written, or when MODEL.gguf is missing and ``--converter`` is given.)

The peer is llama.cpp through its Python binding, in a virtual environment of its own
(never the project's)::

    python3 -m venv PEER && CMAKE_BUILD_PARALLEL_LEVEL=2 PEER/bin/pip install llama-cpp-python

``convert_hf_to_gguf.py`` and its ``conversion/`` and ``gguf-py/`` are in the
llama-cpp-python sdist (``vendor/llama.cpp``); the converter imports torch (a CPU wheel in
PEER). Without a tokenizer in MODEL_DIR it writes its built-in GPT-NeoX vocabulary (that
of state-spaces/mamba-*), padded to the model's vocab size. ``--peer-python`` defaults to
``$LLAMA_CPP_PYTHON`` or ``/work/peers/llama/bin/python``. Without the peer, the model
directory or the GGUF, the script prints one line, writes ``{"skipped": 1, ...}`` and
exits 0 (the figures are a comparison: nothing is measured alone).

What is measured. Each engine runs in a child process of its own (the ssmserve child on
this interpreter, the llama.cpp child on the peer's), both on 2 threads
(``SSMSERVE_ENGINE_THREADS`` / BLAS pinned to 2; llama.cpp ``n_threads`` and
``n_threads_batch`` 2), and they take turns: in every round each child runs all of its
measurements while the other waits, the first child alternating, so both share the
machine's load alike. Token ids are the same for both (random, below 50277: real tokens
of the GPT-NeoX vocabulary). Per round:

* ``prefill``: a ``--prompt``-token prompt from a fresh state, the last position's
  logits. ssmserve: ``MambaModel.prefill(ids, outputs="last")``. llama.cpp: the
  sequence's memory cleared (``llama_memory_seq_rm``), then one ``llama_decode`` of the
  prompt (``n_batch`` = ``n_ubatch`` = the prompt, logits for the last token only) and
  its logits copied out.
* ``step`` (batch 1): ``--steps`` decode steps of that session, one token each, timed
  one by one. ssmserve: ``MambaModel.step`` on the session's batch (the engine's step;
  the stepper's ``BatchState.stack`` copy of a parked session is not in it). llama.cpp:
  ``llama_decode`` of a one-token batch and its logits copied out.
* ``save``: one session's state, ``--saves`` times. ssmserve: ``Checkpoint.encode`` of
  that session's state in the packed form a snapshot holds, with a 64-input history
  (what ``ssmserve model bench DIR --checkpoint`` times; the packing copy out of the
  batch is timed apart as ``pack``). llama.cpp: ``llama_state_seq_get_size`` +
  ``llama_state_seq_get_data`` of the sequence into a new buffer (the state of one
  sequence; ``Llama.save_state()`` would also copy the binding's n_ctx x n_vocab score
  buffer). Each side beside ``memcpy``: its state's bytes copied into a new buffer
  (``ndarray.tobytes``) in the same round.
* ``step8``: ``--batch`` sessions stepped together, ``--batch-steps`` times from fresh
  states. ssmserve: ``MambaModel.step`` of a batch of 8. llama.cpp: a context with
  ``n_seq_max`` 8, one ``llama_decode`` of 8 tokens (one per sequence, logits for each)
  and the 8 rows of logits copied out.

llama.cpp's OpenMP wait policy. Its CPU backend meets an OpenMP barrier at every node of
the graph (~1,200 a step here), and libgomp's default policy spins there before sleeping:
on a shared 2-core machine with other work running, a spinning thread holds a core its
partner needs: a batch-1 step took 0.1-3 s instead of ~40 ms (and slowed the other children
too). So its children run with ``OMP_WAIT_POLICY=PASSIVE`` (``--llama-wait``: one child per
policy, e.g. ``default,passive``; each figure of llama.cpp is the best of its children).

The memcpy of each side is timed in its own process: ssmserve's keeps freed heap pages
(``engine/allocator.py``), so its copy reuses warm pages, while a copy in llama.cpp's
process may fault fresh pages in; the goal reads ssmserve's save against ssmserve's memcpy.

Agreement (before the rounds): the prompt's last logits and ``--check-steps`` decode
steps after it on both engines; the largest absolute difference, the largest |logit| for
scale, and whether every argmax agrees.

Prints a table, then one JSON object on its last line: medians in milliseconds, and
``*_ratio`` = ssmserve / llama.cpp (below 1: ssmserve is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from harness import standard_parser, write_result

THREADS = 2
#: Token ids below this are real tokens of the GPT-NeoX vocabulary both engines use.
TOKEN_LIMIT = 50277
DEFAULT_PEER = "/work/peers/llama/bin/python"
#: The issue's goals: prefill time over llama.cpp's, per architecture; save over memcpy.
PREFILL_GOAL = {"mamba": 0.5, "mamba2": 1.0}
SAVE_OVER_MEMCPY_GOAL = 3.0


# ----------------------------------------------------------------------------- children


def protocol_channel() -> Any:
    """The child's answers go to the original stdout; anything else printed there (C
    libraries' logs) is sent to stderr instead."""
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return channel


class OursChild:
    """ssmserve's engine on the model directory."""

    def __init__(self, args: argparse.Namespace, ids: dict[str, np.ndarray]) -> None:
        os.environ["SSMSERVE_ENGINE_THREADS"] = str(THREADS)
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from ssmserve.server.engine.loader import load_model
        from ssmserve.server.engine.numerics import blas_signature, pin_blas_threads

        pin_blas_threads(THREADS)
        self.model = load_model(args.model, quantize=args.quantize)
        self.ids = ids
        self.info = {
            "engine": "ssmserve",
            "model": self.model.name,
            "vocab": self.model.config.vocab_size,
            "threads": self.model.threads,
            "blas": blas_signature(),
            "state_bytes": self.model.config.state_bytes,
        }
        self.round()  # compiles, allocates

    def check(self, steps: int) -> np.ndarray:
        from ssmserve.server.engine.recurrent_state import BatchState

        last, state = self.model.prefill(self.ids["prompt"], outputs="last")
        rows = [np.array(last[0], np.float32)]
        batch = BatchState.stack([state])
        for token in self.ids["decode"][:steps]:
            batch, out = self.model.step(batch, np.array([token]))
            rows.append(np.array(out[0], np.float32))
        return np.stack(rows)

    def round(self) -> dict[str, Any]:
        from ssmserve.server.engine.recurrent_state import BatchState, SessionState
        from ssmserve.server.state.checkpoint import Checkpoint, InputHistory

        model, ids, c = self.model, self.ids, self.model.config
        t0 = time.perf_counter()
        _, state = model.prefill(ids["prompt"], outputs="last")
        prefill_s = time.perf_counter() - t0
        batch = BatchState.stack([state])
        steps = []
        for token in ids["decode"]:
            t0 = time.perf_counter()
            batch, _ = model.step(batch, np.array([token]))
            steps.append(time.perf_counter() - t0)
        session = batch.session(0)
        t0 = time.perf_counter()
        packed = session.packed()
        pack_s = time.perf_counter() - t0
        parked = SessionState.unpacked(
            packed, c.num_hidden_layers, c.conv_state_shape, c.ssm_state_shape
        )
        at = len(ids["prompt"])  # the history: the prompt's last 64 inputs, up to ``at``
        kept = ids["prompt"][-64:].astype(np.int64)
        history = InputHistory(at - len(kept) + 1, kept)
        ckpt = Checkpoint("bench", at, model.name, "0" * 64, parked, history)
        saves, memcpys = [], []
        for _ in range(len(ids["saves"])):
            t0 = time.perf_counter()
            ckpt.encode()
            saves.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            packed.tobytes()
            memcpys.append(time.perf_counter() - t0)
        batch8 = BatchState.stack([model.new_state()] * ids["batch"].shape[1])
        steps8 = []
        for row in ids["batch"]:
            t0 = time.perf_counter()
            batch8, _ = model.step(batch8, row)
            steps8.append(time.perf_counter() - t0)
        return {
            "prefill": [prefill_s],
            "step": steps,
            "save": saves,
            "memcpy": memcpys,
            "pack": [pack_s],
            "step8": steps8,
            "saved_bytes": len(ckpt.encode()),
        }


class LlamaChild:
    """llama.cpp through its binding's C API (``llama_cpp``), on the GGUF."""

    def __init__(self, args: argparse.Namespace, ids: dict[str, np.ndarray]) -> None:
        import ctypes

        import llama_cpp as ll

        self.ll, self.ctypes = ll, ctypes
        ll.llama_backend_init()
        mparams = ll.llama_model_default_params()
        mparams.use_mmap = False  # weights read into memory, as ssmserve's loader does
        if os.environ.get("BENCH_LLAMA_NO_EXTRA_BUFTS") == "1":
            # llama.cpp 0.3.36's AMX repacking of Q8_0 weights crashes (SIGSEGV) on this
            # host's Xeon with AMX: its plain CPU buffers instead (--llama-no-extra-bufts,
            # which also sets it for F32, so both formats are measured alike)
            mparams.use_extra_bufts = False
        self.model = ll.llama_model_load_from_file(str(args.gguf).encode(), mparams)
        if not self.model:
            raise SystemExit(f"llama.cpp could not load {args.gguf}")
        self.vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.model))
        prompt = len(ids["prompt"])
        self.ctx1 = self._context(prompt, 1, prompt + len(ids["decode"]) + 64)
        width = ids["batch"].shape[1]
        self.ctx8 = self._context(width, width, len(ids["batch"]) + 64)
        self.ids = ids
        self.prompt_batch = self._batch(ids["prompt"], [0] * prompt, range(prompt), prompt - 1)
        self.one = self._batch([0], [0], [0], 0)
        self.wide = self._batch([0] * width, range(width), [0] * width, None)
        self.info = {
            "engine": "llama.cpp",
            "llama_cpp_python": ll.__version__,
            "vocab": self.vocab,
            "threads": THREADS,
            "system": ll.llama_print_system_info().decode(errors="replace").strip(),
        }
        self.round()  # allocates, warms

    def _context(self, n_batch: int, n_seq: int, n_ctx: int) -> Any:
        ll = self.ll
        params = ll.llama_context_default_params()
        params.n_ctx = n_ctx * n_seq
        params.n_batch = params.n_ubatch = n_batch
        params.n_seq_max = n_seq
        params.n_threads = params.n_threads_batch = THREADS
        params.embeddings = False
        ctx = ll.llama_init_from_model(self.model, params)
        if not ctx:
            raise SystemExit("llama.cpp could not make a context")
        return ctx

    def _batch(self, tokens: Any, seqs: Any, positions: Any, logits_at: int | None) -> Any:
        """A prepared ``llama_batch`` (``logits_at`` None: logits for every token)."""
        tokens, seqs, positions = list(tokens), list(seqs), list(positions)
        batch = self.ll.llama_batch_init(len(tokens), 0, max(seqs) + 1)
        batch.n_tokens = len(tokens)
        for i, (token, seq, pos) in enumerate(zip(tokens, seqs, positions, strict=True)):
            batch.token[i] = int(token)
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = logits_at is None or i == logits_at
        return batch

    def _decode(self, ctx: Any, batch: Any) -> None:
        rc = self.ll.llama_decode(ctx, batch)
        if rc != 0:
            raise SystemExit(f"llama_decode returned {rc}")

    def _logits(self, ctx: Any, rows: int) -> np.ndarray:
        """The batch's ``rows`` outputs' logits, copied out (rows, vocab)."""
        ptr = self.ll.llama_get_logits(ctx)  # synchronises
        return np.ctypeslib.as_array(ptr, (rows, self.vocab)).copy()

    def _prefill(self) -> np.ndarray:
        ll = self.ll
        ll.llama_memory_seq_rm(ll.llama_get_memory(self.ctx1), 0, -1, -1)
        self._decode(self.ctx1, self.prompt_batch)
        return self._logits(self.ctx1, 1)[0]

    def _step(self, token: int, pos: int) -> np.ndarray:
        self.one.token[0] = int(token)
        self.one.pos[0] = pos
        self._decode(self.ctx1, self.one)
        return self._logits(self.ctx1, 1)[0]

    def check(self, steps: int) -> np.ndarray:
        rows = [self._prefill()]
        prompt = len(self.ids["prompt"])
        for i, token in enumerate(self.ids["decode"][:steps]):
            rows.append(self._step(token, prompt + i))
        return np.stack(rows)

    def round(self) -> dict[str, Any]:
        ll, ctypes, ids = self.ll, self.ctypes, self.ids
        t0 = time.perf_counter()
        self._prefill()
        prefill_s = time.perf_counter() - t0
        prompt = len(ids["prompt"])
        steps = []
        for i, token in enumerate(ids["decode"]):
            t0 = time.perf_counter()
            self._step(token, prompt + i)
            steps.append(time.perf_counter() - t0)
        saves, memcpys, size = [], [], 0
        for _ in range(len(ids["saves"])):
            t0 = time.perf_counter()
            size = ll.llama_state_seq_get_size(self.ctx1, 0)
            buffer = np.empty(size, np.uint8)
            dst = buffer.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
            written = ll.llama_state_seq_get_data(self.ctx1, dst, size, 0)
            saves.append(time.perf_counter() - t0)
            if written != size:
                raise SystemExit(f"llama_state_seq_get_data wrote {written} of {size} bytes")
            t0 = time.perf_counter()
            buffer.tobytes()
            memcpys.append(time.perf_counter() - t0)
        ll.llama_memory_clear(ll.llama_get_memory(self.ctx8), True)
        steps8 = []
        for pos, row in enumerate(ids["batch"]):
            for i, token in enumerate(row):
                self.wide.token[i] = int(token)
                self.wide.pos[i] = pos
            t0 = time.perf_counter()
            self._decode(self.ctx8, self.wide)
            self._logits(self.ctx8, len(row))
            steps8.append(time.perf_counter() - t0)
        return {
            "prefill": [prefill_s],
            "step": steps,
            "save": saves,
            "memcpy": memcpys,
            "step8": steps8,
            "saved_bytes": int(size),
        }


def child_main(args: argparse.Namespace) -> int:
    channel = protocol_channel()
    loaded = np.load(args.ids)
    ids = {name: loaded[name] for name in loaded.files}
    engine = OursChild(args, ids) if args.child == "ours" else LlamaChild(args, ids)
    channel.write(json.dumps(engine.info) + "\n")
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "check":
            np.save(command["path"], engine.check(command["steps"]))
            channel.write("{}\n")
        elif command["op"] == "round":
            channel.write(json.dumps(engine.round()) + "\n")
        else:
            break
    return 0


# ------------------------------------------------------------------------------- parent


class Child:
    """A child process answering one JSON line per command."""

    def __init__(
        self,
        name: str,
        python: str,
        args: argparse.Namespace,
        ids: Path,
        env: dict[str, str] | None = None,
    ) -> None:
        kind = "ours" if name == "ours" else "llama"
        cmd = [python, str(Path(__file__).resolve()), "--child", kind, "--ids", str(ids)]
        cmd += ["--model", str(args.model), "--gguf", str(args.gguf)]
        cmd += ["--quantize", args.quantize]
        self.name = name
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.info = self._answer()

    def _answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the {self.name} child exited ({self.proc.wait()})")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def ask(self, **command: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def skipped(reason: str, json_path: Path | None) -> int:
    print(f"bench_llama_cpp: skipped ({reason}); see the usage in bench/bench_llama_cpp.py")
    if json_path:
        write_result(json_path, {"skipped": 1, "notes": f"skipped: {reason}"}, line=False)
    return 0


def peer_missing(args: argparse.Namespace) -> str | None:
    """Why the comparison cannot run, or None. Writes what is missing and can be made: the
    model directory (``--arch``, random weights) and, given the converter, the GGUF."""
    if not Path(args.peer_python).is_file():
        return f"no llama.cpp peer interpreter at {args.peer_python}"
    probe = subprocess.run(
        [args.peer_python, "-c", "import llama_cpp"], capture_output=True, timeout=120
    )
    if probe.returncode != 0:
        return f"llama_cpp does not import in {args.peer_python}"
    if not args.model.joinpath("config.json").is_file():
        maker = Path(__file__).resolve().parent / "tools" / "make_mamba_130m.py"
        cmd = [sys.executable, str(maker), str(args.model), "--arch", args.arch]
        subprocess.run(cmd, check=True, timeout=600)
    if not args.gguf.is_file():
        if not args.converter or not Path(args.converter).is_file():
            return f"no GGUF at {args.gguf}, and no converter (--converter) to write it"
        outtype = "q8_0" if args.quantize == "q8_0" else "f32"
        cmd = [args.peer_python, args.converter, str(args.model), "--outtype", outtype]
        subprocess.run([*cmd, "--outfile", str(args.gguf)], check=True, timeout=1800)
    return None


def median_ms(samples: list[float]) -> float:
    return float(np.median(samples) * 1e3)


def agreement(ours: np.ndarray, peer: np.ndarray) -> dict[str, Any]:
    vocab = min(ours.shape[1], peer.shape[1])
    a, b = ours[:, :vocab].astype(np.float64), peer[:, :vocab].astype(np.float64)
    return {
        "rows": int(a.shape[0]),
        "max_abs_diff": float(np.max(np.abs(a - b))),
        "prompt_max_abs_diff": float(np.max(np.abs(a[0] - b[0]))),
        "max_abs_logit": float(np.max(np.abs(a))),
        "argmax_equal": bool(np.array_equal(a.argmax(axis=1), b.argmax(axis=1))),
    }


def parent_main(args: argparse.Namespace) -> int:
    reason = peer_missing(args)
    if reason:
        return skipped(reason, args.json)
    config = json.loads(args.model.joinpath("config.json").read_text())
    arch = "mamba2" if config.get("model_type") == "mamba2" else "mamba"
    rng = np.random.default_rng(0)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-llama-cpp-") as tmp:
        ids_path = Path(tmp) / "ids.npz"
        np.savez(
            ids_path,
            prompt=rng.integers(0, TOKEN_LIMIT, args.prompt),
            decode=rng.integers(0, TOKEN_LIMIT, args.steps),
            saves=np.zeros(args.saves),
            batch=rng.integers(0, TOKEN_LIMIT, (args.batch_steps, args.batch)),
        )
        children = [Child("ours", sys.executable, args, ids_path)]
        for wait in args.llama_wait.split(","):
            env = {"OMP_WAIT_POLICY": wait.upper()} if wait != "default" else {}
            if args.llama_no_extra_bufts:
                env["BENCH_LLAMA_NO_EXTRA_BUFTS"] = "1"
            children.append(Child(f"llama_{wait}", args.peer_python, args, ids_path, env))
        for child in children:
            child.ask(op="check", path=str(Path(tmp) / f"{child.name}.npy"), steps=args.check_steps)
        first_peer = children[1].name
        agree = agreement(np.load(Path(tmp) / "ours.npy"), np.load(Path(tmp) / f"{first_peer}.npy"))
        samples: dict[str, dict[str, list[float]]] = {c.name: {} for c in children}
        saved_bytes: dict[str, int] = {}
        for r in range(args.rounds):
            for child in children[r % len(children) :] + children[: r % len(children)]:
                answer = child.ask(op="round")
                saved_bytes[child.name] = answer.pop("saved_bytes")
                for key, values in answer.items():
                    samples[child.name].setdefault(key, []).extend(values)
        infos = {c.name: c.info for c in children}
        for child in children:
            child.close()
    load_after = os.getloadavg()
    ours = {k: median_ms(v) for k, v in samples["ours"].items()}
    variants = {
        name: {k: median_ms(v) for k, v in kinds.items()}
        for name, kinds in samples.items()
        if name != "ours"
    }
    # llama.cpp's figure: the best of its variants, each figure on its own
    peer = {k: min(v[k] for v in variants.values()) for k in variants[first_peer]}
    best = {k: min(variants, key=lambda name: variants[name][k]) for k in peer}
    report: dict[str, Any] = {
        "arch": arch,
        "model": str(args.model),
        "gguf": str(args.gguf),
        "quantize": args.quantize,
        "llama_no_extra_bufts": args.llama_no_extra_bufts,
        "prompt": args.prompt,
        "rounds": args.rounds,
        "steps": args.steps * args.rounds,
        "batch": args.batch,
        "threads": THREADS,
        "agreement": agree,
        "ssmserve_ms": ours,
        "llama_cpp_ms": peer,
        "llama_cpp_variants_ms": variants,
        "llama_cpp_best_variant": best,
        "ssmserve_saved_bytes": saved_bytes["ours"],
        "llama_cpp_saved_bytes": saved_bytes[first_peer],
        "prefill_ratio": ours["prefill"] / peer["prefill"],
        "step_ratio": ours["step"] / peer["step"],
        "step8_ratio": ours["step8"] / peer["step8"],
        "save_ratio": ours["save"] / peer["save"],
        "ssmserve_save_over_memcpy": ours["save"] / ours["memcpy"],
        "llama_cpp_save_over_memcpy": peer["save"] / peer["memcpy"],
        "prefill_goal": PREFILL_GOAL[arch],
        "save_over_memcpy_goal": SAVE_OVER_MEMCPY_GOAL,
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in load_after],
        "ssmserve": infos["ours"],
        "llama_cpp": infos[first_peer],
    }
    report["prefill_goal_met"] = report["prefill_ratio"] <= PREFILL_GOAL[arch]
    report["save_goal_met"] = report["ssmserve_save_over_memcpy"] <= SAVE_OVER_MEMCPY_GOAL
    print_table(report)
    if args.json:
        write_result(args.json, report, line=False)
    print(json.dumps(report))
    return 0


def print_table(report: dict[str, Any]) -> None:
    ours, peer = report["ssmserve_ms"], report["llama_cpp_ms"]
    a = report["agreement"]
    print(
        f"# {report['arch']}-130m-shaped, {report['threads']} threads each, "
        f"{report['rounds']} interleaved rounds; load {report['load_before']} -> "
        f"{report['load_after']}"
    )
    print(
        f"agreement over {a['rows']} positions: max |diff| {a['max_abs_diff']:.3g} "
        f"(prompt {a['prompt_max_abs_diff']:.3g}), max |logit| {a['max_abs_logit']:.3g}, "
        f"argmax equal: {a['argmax_equal']}"
    )
    rows = [
        (f"prefill {report['prompt']} tokens, last logits", "prefill"),
        ("decode step, batch 1", "step"),
        (f"decode step, batch {report['batch']}", "step8"),
        ("save one session's state", "save"),
        ("memcpy of that state", "memcpy"),
    ]
    variants = report["llama_cpp_variants_ms"]
    heads = "".join(f" {name.replace('llama_', 'llama.cpp ') + ' ms':>22s}" for name in variants)
    print(f"{'':36s} {'ssmserve ms':>12s}{heads} {'ratio to best':>14s}")
    for label, key in rows:
        cells = "".join(f" {v[key]:22.3f}" for v in variants.values())
        print(f"{label:36s} {ours[key]:12.3f}{cells} {ours[key] / peer[key]:14.3f}")
    print(
        f"saved bytes: ssmserve {report['ssmserve_saved_bytes']:,}, "
        f"llama.cpp {report['llama_cpp_saved_bytes']:,}; save / memcpy: ssmserve "
        f"{report['ssmserve_save_over_memcpy']:.2f}, llama.cpp "
        f"{report['llama_cpp_save_over_memcpy']:.2f}"
    )
    print(
        f"goals: prefill ratio <= {report['prefill_goal']}: {report['prefill_goal_met']}; "
        f"ssmserve save <= {SAVE_OVER_MEMCPY_GOAL}x memcpy: {report['save_goal_met']}"
    )


def main() -> int:
    parser = standard_parser(__doc__, rounds=5)
    parser.add_argument("--model", type=Path, required=True, help="HF-format model directory")
    parser.add_argument("--gguf", type=Path, required=True, help="that model as an F32 GGUF")
    parser.add_argument(
        "--peer-python",
        default=os.environ.get("LLAMA_CPP_PYTHON", DEFAULT_PEER),
        help="the interpreter with llama_cpp ($LLAMA_CPP_PYTHON or %(default)s)",
    )
    parser.add_argument(
        "--converter",
        default=os.environ.get("LLAMA_CPP_CONVERTER"),
        help="llama.cpp's convert_hf_to_gguf.py, to write a missing GGUF ($LLAMA_CPP_CONVERTER)",
    )
    parser.add_argument(
        "--arch",
        choices=("mamba", "mamba2"),
        default="mamba",
        help="the model bench/tools/make_mamba_130m.py writes when --model has none (mamba)",
    )
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens (512)")
    parser.add_argument("--steps", type=int, default=10, help="batch-1 steps a round (10)")
    parser.add_argument("--saves", type=int, default=5, help="state saves a round (5)")
    parser.add_argument("--batch", type=int, default=8, help="sessions stepped together (8)")
    parser.add_argument("--batch-steps", type=int, default=5, help="batch steps a round (5)")
    parser.add_argument("--check-steps", type=int, default=4, help="steps compared (4)")
    parser.add_argument(
        "--llama-wait",
        default="passive",
        help="llama.cpp children, one per OMP_WAIT_POLICY, comma-separated ('default': "
        "unset, libgomp's spin-then-sleep) (passive)",
    )
    parser.add_argument(
        "--quantize",
        choices=("none", "q8_0"),
        default="none",
        help="q8_0: ssmserve loads MODEL with quantize='q8_0' and --gguf is the Q8_0 GGUF "
        "of it (written with --outtype q8_0 when missing): both engines on 8-bit weights",
    )
    parser.add_argument(
        "--llama-no-extra-bufts",
        action="store_true",
        help="load llama.cpp's weights without its extra buffer types (AMX repacking): "
        "its Q8_0 Mamba crashes with them on a CPU with AMX (llama-cpp-python 0.3.36)",
    )
    parser.add_argument("--child", choices=("ours", "llama"), help=argparse.SUPPRESS)
    parser.add_argument("--ids", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child_main(args)
    return parent_main(args)


if __name__ == "__main__":
    raise SystemExit(main())
