"""Where ssmserve's float32 logit error comes from: a float64 re-implementation of the
Mamba-1 step (``engine/mamba.py``, ``engine/kernels.py``) in which the engine's own float32
kernels are swapped in one piece at a time (``bench_accuracy.py --diagnose`` calls it).

The pieces (each swapped in with its inputs rounded to float32, its output kept float32):

* ``products``: the block products (in_proj, x_proj, dt_proj, out_proj) through
  ``products.product_rows`` (fma chains over fixed blocks of 64 k, the block sums added
  in order); ``head``: the head's.
* ``conv``: ``kernels.conv_silu`` (window, sum, SiLU through the Cephes exp).
* ``scan``: ``kernels.selective_scan`` (softplus, exp(Δ A), the state update, the
  readout ``_dot_in_order``, the gate), with A = -exp(A_log) in float32 as the loader has it.
* ``norms``: the residual stream (float64 in the engine) and ``kernels.rms_norm_rows``
  (float64, its output rounded once to float32); ``f32stream``: the same with the stream
  stored in float32 after each block.

All pieces swapped in is the engine itself (checked: the same bits as ``MambaModel.run``).
Two readings: each piece alone in float32 (the rest float64): the error it brings; the
engine with one piece in float64: what computing that piece exactly would gain.

Inside the scan, a numpy float64 scan with one sub-piece in float32 at a time:
``softplus`` (the kernels' log1p(exp) on float32, or correctly rounded), ``exp`` (Cephes
on the float32 argument, or correctly rounded), ``state`` (h kept in float32),
``readout`` (``_dot_in_order`` in float32), ``gate``.

Other fixed orders per element (batch-invariant), swapped in for the products and the
head of the otherwise unchanged engine: ``chain`` (one fma chain over all of k),
``blocked<B>`` (fma chains over blocks of B k, the block sums added in order: the engine
is ``blocked64``), ``lanes8`` (8 chains over k mod 8, added in a fixed tree), ``f64acc``
(float64 accumulation, rounded once).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from numba import njit

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ssmserve.server.engine import kernels
from ssmserve.server.engine.products import NO_SCALES, pack_panels, product_rows

F32, F64 = np.float32, np.float64
_FLAGS = {"cache": True, "fastmath": {"contract"}, "boundscheck": False}


# ------------------------------------------------------------------ product variants


@njit(**_FLAGS)
def _chain(x: np.ndarray, wt: np.ndarray, block: int, out: np.ndarray) -> None:
    """out[t, j] = sum_k x[t, k] wt[k, j]: an fma chain over each ``block`` of k, each
    block's sum added to a running sum (block >= i: the engine's single chain)."""
    rows, depth = x.shape
    o = wt.shape[1]
    acc = np.zeros(o, np.float32)
    total = np.zeros(o, np.float32)
    for t in range(rows):
        total[:] = 0.0
        for k0 in range(0, depth, block):
            acc[:] = 0.0
            for k in range(k0, min(k0 + block, depth)):
                xk = x[t, k]
                for j in range(o):
                    acc[j] += xk * wt[k, j]
            if k0 == 0:
                total[:] = acc
            else:
                for j in range(o):
                    total[j] += acc[j]
        out[t] = total


@njit(**_FLAGS)
def _lanes8(x: np.ndarray, wt: np.ndarray, out: np.ndarray) -> None:
    """8 fma chains over k mod 8, added as ((a0+a1)+(a2+a3))+((a4+a5)+(a6+a7))."""
    rows, depth = x.shape
    o = wt.shape[1]
    acc = np.zeros((8, o), np.float32)
    for t in range(rows):
        acc[:] = 0.0
        for k in range(depth):
            xk = x[t, k]
            lane = k % 8
            for j in range(o):
                acc[lane, j] += xk * wt[k, j]
        for j in range(o):
            out[t, j] = ((acc[0, j] + acc[1, j]) + (acc[2, j] + acc[3, j])) + (
                (acc[4, j] + acc[5, j]) + (acc[6, j] + acc[7, j])
            )


class Product:
    """One product ``x @ w.T (+ bias)`` in one of the variants (float64 in and out)."""

    def __init__(self, weight: np.ndarray, bias: np.ndarray | None = None) -> None:
        self.weight = weight  # (o, i) float32
        self.bias = bias

    def __call__(self, x: np.ndarray, variant: str) -> np.ndarray:
        w = self.weight
        if variant == "f64":
            out = x @ w.T.astype(F64)
            return out if self.bias is None else out + self.bias
        x32 = np.ascontiguousarray(x, dtype=F32)
        out32 = np.empty((x.shape[0], w.shape[0]), F32)
        if variant == "engine":
            panels = pack_panels(w)
            has = self.bias is not None
            bias = self.bias if has else np.zeros(1, F32)
            product_rows(x32, panels, NO_SCALES, bias, has, 0, x.shape[0], out32)
            return out32.astype(F64)
        wt = np.ascontiguousarray(w.T)
        if variant == "chain":
            _chain(x32, wt, x.shape[1], out32)
        elif variant.startswith("blocked"):  # blocked<B>: an fma chain per B of k
            _chain(x32, wt, int(variant[len("blocked") :]), out32)
        elif variant == "lanes8":
            _lanes8(x32, wt, out32)
        elif variant == "f64acc":
            out32[:] = (x32.astype(F64) @ wt.astype(F64)).astype(F32)
        else:
            raise ValueError(variant)
        if self.bias is not None:
            out32 += self.bias  # the engine adds the bias after the sum, in float32
        return out32.astype(F64)


# ------------------------------------------------------------------ elementwise pieces


@njit(**_FLAGS)
def softplus_f32(raw: np.ndarray) -> np.ndarray:
    """The kernels' softplus (Cephes exp, then log1p) on a 1-d float32 array."""
    n = raw.shape[0]
    out = np.empty_like(raw)
    kernels._softplus_into(raw, out, np.empty(2 * n, np.float32), np.empty(n, np.int32))
    return out


def _softplus64(v: np.ndarray) -> np.ndarray:
    return np.where(v > 20.0, v, np.log1p(np.exp(np.minimum(v, 20.0))))


def _silu64(v: np.ndarray) -> np.ndarray:
    return v / (1.0 + np.exp(-v))


def _f32(v: np.ndarray) -> np.ndarray:
    return v.astype(F32).astype(F64)


# ------------------------------------------------------------------ the model


class Weights:
    """The float32 tensors of a Mamba-1 model directory, read once."""

    def __init__(self, model_dir: Path) -> None:
        import json

        from safetensors.numpy import load_file

        config = json.loads((model_dir / "config.json").read_text())
        self.layers = config["num_hidden_layers"]
        self.eps = config["layer_norm_epsilon"]
        self.n = config["state_size"]
        self.rank = config["time_step_rank"]
        t = load_file(model_dir / "model.safetensors")
        self.emb = t.pop("backbone.embeddings.weight")
        self.norm_f = t.pop("backbone.norm_f.weight")
        self.head = Product(t.pop("lm_head.weight", self.emb))  # tied unless it has its own
        self.t = t

    def layer(self, i: int) -> dict[str, Any]:
        p = f"backbone.layers.{i}."
        t = self.t
        m = p + "mixer."
        return {
            "norm": t[p + "norm.weight"],
            "in": Product(t[m + "in_proj.weight"]),
            "conv_w": np.ascontiguousarray(t[m + "conv1d.weight"][:, 0, :]),
            "conv_b": t[m + "conv1d.bias"],
            "x": Product(t[m + "x_proj.weight"]),
            "dt": Product(t[m + "dt_proj.weight"], t[m + "dt_proj.bias"]),
            "A_log": t[m + "A_log"],
            "D": t[m + "D"],
            "out": Product(t[m + "out_proj.weight"]),
        }


def forward(w: Weights, ids: np.ndarray, cfg: dict[str, str]) -> np.ndarray:
    """Logits (T, v) float64 of the token ids, layer by layer over the whole sequence (each
    position's arithmetic is that of the step), with each piece as ``cfg`` says:
    ``products``/``head``: a Product variant; ``conv``, ``scan``, ``norms``: "engine" or
    "f64"; ``scan_sub``: the one float32 sub-piece of the float64 scan."""
    h = w.emb[ids].astype(F64)  # (T, d) residual stream
    for i in range(w.layers):
        lw = w.layer(i)
        xn = _norm_only(h, lw["norm"], w.eps, cfg["norms"])
        xz = lw["in"](xn, cfg["products"])  # (T, 2e)
        e = xz.shape[1] // 2
        xs = _conv(xz[:, :e], lw, cfg["conv"])  # (T, e)
        x_dbl = lw["x"](xs, cfg["products"])  # (T, r + 2n)
        dt_raw = lw["dt"](x_dbl[:, : w.rank], cfg["products"])  # (T, e)
        y = _scan(dt_raw, xs, x_dbl, xz[:, e:], lw, w, cfg)  # (T, e)
        delta = lw["out"](y, cfg["products"])  # (T, d)
        h = h + delta
        if cfg["norms"] == "f32stream":
            h = _f32(h)  # the residual stream stored in float32
    xn = _norm_only(h, w.norm_f, w.eps, cfg["norms"])
    return w.head(xn, cfg["head"])


def _norm_only(h: np.ndarray, weight: np.ndarray, eps: float, how: str) -> np.ndarray:
    if how in ("engine", "f32stream"):  # the kernel: float64, its output rounded once
        h64 = np.ascontiguousarray(h, dtype=F64)
        out = np.empty(h64.shape, F32)
        kernels.rms_norm_rows(h64, weight, F64(eps), h64.shape[0], out)
        return out.astype(F64)
    inv = 1.0 / np.sqrt((h * h).mean(axis=1, keepdims=True) + eps)
    return h * inv * weight


def _conv(x: np.ndarray, lw: dict[str, Any], how: str) -> np.ndarray:
    T, e = x.shape
    wc, bc = lw["conv_w"], lw["conv_b"]
    k = wc.shape[1]
    if how == "engine":
        conv = np.zeros((1, e, k), F32)
        nxt = np.empty_like(conv)
        out = np.empty((T, e), F32)
        scratch = np.empty(3 * e, F32)
        xz = np.zeros((1, 2 * e), F32)
        for t in range(T):
            xz[0, :e] = x[t]
            row = np.empty((1, e), F32)
            kernels.conv_silu(conv, xz, wc, bc, True, nxt, row, scratch)
            out[t] = row[0]
            conv, nxt = nxt, conv
        return out.astype(F64)
    padded = np.concatenate([np.zeros((k - 1, e)), x], axis=0)  # (T + k - 1, e)
    s = np.zeros((T, e))
    for tap in range(k):
        s = s + padded[tap : tap + T] * wc[:, tap]
    return _silu64(s + bc)


def _scan(
    dt_raw: np.ndarray,
    xs: np.ndarray,
    x_dbl: np.ndarray,
    z: np.ndarray,
    lw: dict[str, Any],
    w: Weights,
    cfg: dict[str, str],
) -> np.ndarray:
    T, e = xs.shape
    n, r = w.n, w.rank
    if cfg["scan"] == "engine":
        A = -np.exp(lw["A_log"])  # float32, as the loader has it
        ssm = np.zeros((1, e, n), F32)
        nxt = np.empty_like(ssm)
        y = np.empty((T, e), F32)
        scratch, bits = np.empty(3 * e, F32), np.empty(e, np.int32)
        for t in range(T):
            row = np.empty((1, e), F32)
            xz = np.zeros((1, 2 * e), F32)
            xz[0, e:] = z[t]
            kernels.selective_scan(
                dt_raw[t : t + 1].astype(F32), xs[t : t + 1].astype(F32),
                x_dbl[t : t + 1].astype(F32), xz, A, lw["D"], ssm, nxt, row, scratch, bits,
            )  # fmt: skip
            y[t] = row[0]
            ssm, nxt = nxt, ssm
        return y.astype(F64)
    sub = cfg.get("scan_sub", "")
    A = -np.exp(lw["A_log"].astype(F64))
    D = lw["D"].astype(F64)
    state = np.zeros((e, n))
    y = np.empty((T, e))
    for t in range(T):
        if sub == "softplus":
            dt = softplus_f32(dt_raw[t].astype(F32)).astype(F64)
        elif sub == "softplus_cr":
            dt = _f32(_softplus64(_f32(dt_raw[t])))
        else:
            dt = _softplus64(dt_raw[t])
        B, C = x_dbl[t, r : r + n], x_dbl[t, r + n :]
        if sub in ("exp", "exp_cr"):
            arg = (dt.astype(F32)[:, None] * A.astype(F32)).ravel()  # (e n,) float32
            ex = kernels.exp_f32(arg) if sub == "exp" else np.exp(arg.astype(F64)).astype(F32)
            a_bar = ex.astype(F64).reshape(e, n)
        else:
            a_bar = np.exp(dt[:, None] * A)
        state = a_bar * state + (dt * xs[t])[:, None] * B
        if sub == "state":
            state = _f32(state)
        if sub == "readout":
            acc = kernels.dot_in_order_f32(state.astype(F32), C.astype(F32)).astype(F64)
        else:
            acc = state @ C
        if sub == "gate":
            zz = z[t].astype(F32)
            gate = (zz / (F32(1) + kernels.exp_f32(-zz))).astype(F64)
            y[t] = _f32(acc + D * xs[t]) * gate
        else:
            y[t] = (acc + D * xs[t]) * _silu64(z[t])
    return y


# ------------------------------------------------------------------ the experiments

PIECES = ("products", "head", "conv", "scan", "norms")


def _config(engine: set[str], **extra: str) -> dict[str, str]:
    cfg = {p: ("engine" if p in engine else "f64") for p in PIECES}
    cfg.update(extra)
    return cfg


def experiments() -> list[tuple[str, dict[str, str]]]:
    all_engine = set(PIECES)
    out: list[tuple[str, dict[str, str]]] = [
        ("float64 re-implementation", _config(set())),
        ("engine (all pieces float32)", _config(all_engine)),
    ]
    out += [(f"only {p} float32", _config({p})) for p in PIECES]
    out += [(f"engine, {p} float64", _config(all_engine - {p})) for p in PIECES]
    out.append(("engine, residual stream float32", _config(all_engine, norms="f32stream")))
    for sub in ("softplus", "softplus_cr", "exp", "exp_cr", "state", "readout", "gate"):
        out.append((f"only scan's {sub} float32", _config(set(), scan_sub=sub)))
    for variant in ("chain", "blocked32", "lanes8", "f64acc"):
        out.append(
            (
                f"engine, products+head {variant}",
                _config(all_engine - {"products", "head"}, products=variant, head=variant),
            )
        )
    return out


def diagnose(
    model_dir: Path,
    ids: np.ndarray,
    reference: np.ndarray,
    engine_logits: np.ndarray | None = None,
    log: Callable[[str], None] = print,
    only: str = "",
) -> dict[str, Any]:
    """Max abs and rms logit error against ``reference`` of every experiment (of those
    whose name contains one of the ``|``-separated words of ``only``, when given)."""
    w = Weights(model_dir)
    rows: list[tuple[str, float]] = []
    result: dict[str, Any] = {}
    for name, cfg in experiments():
        if only and not any(word in name for word in only.split("|")):
            continue
        logits = forward(w, ids, cfg)
        err = float(np.abs(logits - reference).max())
        rms = float(np.sqrt(np.mean((logits - reference) ** 2)))
        agree = int((logits.argmax(1) == reference.argmax(1)).sum())
        rows.append((name, err))
        result[name] = {"max_abs": err, "rms": rms, "argmax_agree": agree}
        if name.startswith("engine (all") and engine_logits is not None:
            result[name]["bits_equal_engine"] = bool(
                np.array_equal(logits.astype(F32), engine_logits)
            )
        log(f"{model_dir.name}: {name}: max {err:.3g}, rms {rms:.3g} ({agree}/{len(ids)} argmax)")
    return {"table": rows, "experiments": result}


if __name__ == "__main__":
    import json

    model_dir, ids_path, ref_path, engine_path, out_path = (Path(a) for a in sys.argv[1:6])
    ref = np.load(ref_path)
    only = sys.argv[6] if len(sys.argv) > 6 else ""
    res = diagnose(model_dir, np.load(ids_path), ref, np.load(engine_path), only=only)
    out_path.write_text(json.dumps(res) + "\n")
