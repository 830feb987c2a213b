"""The GPU engine's peers in ``bench/tools/gpu_check.py``: a plain PyTorch step (cuBLAS products,
torch elementwise ops; eager and, on a GPU, replayed as a CUDA graph) and transformers'
``*ForCausalLM`` where it is installed.

The plain step is the speed bar of issue 43 ("a plain PyTorch Mamba step replayed as a
CUDA graph"): what a few dozen lines of torch do, with no exactness promise (cuBLAS picks
its order by the batch's shape). It is also checked against the CPU engine, so its
figures are those of a correct step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ssmserve.server.engine.config import MambaConfig


def _rms(h: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))


class PlainStep:
    """One token step of a Mamba / Mamba-2 LM in plain torch, states updated in place
    (``conv`` (b, c, k) and ``ssm`` per layer), logits returned."""

    def __init__(self, config: MambaConfig, tensors: dict[str, np.ndarray], device: Any) -> None:
        self.c = config
        self.t = {
            k: torch.from_numpy(np.asarray(v, np.float32)).to(device) for k, v in tensors.items()
        }
        self.head = self.t.get("lm_head.weight", self.t["backbone.embeddings.weight"])
        self.device = device

    def new_states(self, batch: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        c = self.c
        conv = [
            torch.zeros((batch, *c.conv_state_shape), device=self.device)
            for _ in range(c.num_hidden_layers)
        ]
        ssm = [
            torch.zeros((batch, *c.ssm_state_shape), device=self.device)
            for _ in range(c.num_hidden_layers)
        ]
        return conv, ssm

    def __call__(
        self, ids: torch.Tensor, conv: list[torch.Tensor], ssm: list[torch.Tensor]
    ) -> torch.Tensor:
        c, t = self.c, self.t
        h = t["backbone.embeddings.weight"][ids]
        for i in range(c.num_hidden_layers):
            p = f"backbone.layers.{i}."
            x = _rms(h, t[p + "norm.weight"], c.layer_norm_epsilon)
            mix = self._mamba2 if c.mamba_version == 2 else self._mamba1
            h = h + mix(x, p + "mixer.", conv[i], ssm[i])
        return _rms(h, t["backbone.norm_f.weight"], c.layer_norm_epsilon) @ self.head.T

    def _conv(self, p: str, conv: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        t = self.t
        conv.copy_(torch.cat([conv[:, :, 1:], new[:, :, None]], dim=2))
        out = (conv * t[p + "conv1d.weight"][:, 0, :]).sum(-1)
        if p + "conv1d.bias" in t:
            out = out + t[p + "conv1d.bias"]
        return F.silu(out)

    def _mamba1(
        self, x: torch.Tensor, p: str, conv: torch.Tensor, ssm: torch.Tensor
    ) -> torch.Tensor:
        c, t = self.c, self.t
        e, n, r = c.intermediate_size, c.state_size, c.time_step_rank
        xz = x @ t[p + "in_proj.weight"].T
        xs = self._conv(p, conv, xz[:, :e])
        x_dbl = xs @ t[p + "x_proj.weight"].T
        dt = F.softplus(x_dbl[:, :r] @ t[p + "dt_proj.weight"].T + t[p + "dt_proj.bias"])
        b, cc = x_dbl[:, r : r + n], x_dbl[:, r + n :]
        a = -torch.exp(t[p + "A_log"])
        ssm.copy_(torch.exp(dt[:, :, None] * a) * ssm + (dt * xs)[:, :, None] * b[:, None, :])
        y = (ssm @ cc[:, :, None])[:, :, 0] + t[p + "D"] * xs
        return (y * F.silu(xz[:, e:])) @ t[p + "out_proj.weight"].T

    def _mamba2(
        self, x: torch.Tensor, p: str, conv: torch.Tensor, ssm: torch.Tensor
    ) -> torch.Tensor:
        c, t = self.c, self.t
        e, n, h, hp, g = c.intermediate_size, c.state_size, c.num_heads, c.head_dim, c.n_groups
        zxbcdt = x @ t[p + "in_proj.weight"].T
        cdim = c.conv_dim
        xbc = self._conv(p, conv, zxbcdt[:, e : e + cdim])
        dt = F.softplus(zxbcdt[:, e + cdim :] + t[p + "dt_bias"])  # (b, h)
        low, high = c.time_step_limit
        dt = dt.clamp(low, min(high, 3.0e38))
        xh = xbc[:, :e].reshape(-1, h, hp)
        bg = xbc[:, e : e + g * n].reshape(-1, g, n).repeat_interleave(h // g, dim=1)
        cg = xbc[:, e + g * n :].reshape(-1, g, n).repeat_interleave(h // g, dim=1)
        decay = torch.exp(dt * -torch.exp(t[p + "A_log"]))  # (b, h)
        ssm.copy_(
            ssm * decay[:, :, None, None] + (dt[:, :, None] * bg)[:, :, None, :] * xh[..., None]
        )
        y = (ssm @ cg[..., None])[..., 0] + xh * t[p + "D"][None, :, None]
        y = y.reshape(-1, e) * F.silu(zxbcdt[:, :e])
        y = y.reshape(-1, g, e // g)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + c.layer_norm_epsilon)
        return (y.reshape(-1, e) * t[p + "norm.weight"]) @ t[p + "out_proj.weight"].T


def sync(device: Any) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_per_call(fn: Callable[[], object], calls: int, device: Any, warmup: int = 2) -> float:
    """Median seconds of ``fn()`` (synchronised) over ``calls`` calls."""
    for _ in range(warmup):
        fn()
    sync(device)
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        sync(device)
        samples.append(time.perf_counter() - start)
    return float(np.median(samples))


def graphed(fn: Callable[[], object], device: Any) -> Callable[[], None]:
    """``fn`` captured once as a CUDA graph (its inputs and outputs static tensors it
    closes over); calling the result replays it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def transformers_model(model_dir: Path, device: Any) -> Any:
    """transformers' ``*ForCausalLM`` of the directory in float32, or raise ImportError."""
    import json

    import transformers

    arch = json.loads((model_dir / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, arch).from_pretrained(model_dir, torch_dtype=torch.float32)
    return model.to(device).eval()


def transformers_logits(model: Any, ids: np.ndarray, device: Any) -> tuple[np.ndarray, float]:
    """transformers' step path over ``ids`` (b, T): logits (b, T, v) and seconds per step
    (the median over steps after the first)."""
    conv_kernel = model.config.conv_kernel
    tokens = torch.from_numpy(ids).to(device)
    rows, seconds = [], []
    with torch.no_grad():
        out = model(input_ids=tokens[:, :1], use_cache=True)
        rows.append(out.logits[:, -1].float().cpu().numpy())
        for t in range(1, tokens.shape[1]):
            sync(device)
            start = time.perf_counter()
            out = model(
                input_ids=tokens[:, t : t + 1],
                cache_params=out.cache_params,
                use_cache=True,
                cache_position=torch.tensor([conv_kernel - 1 + t], device=device),
            )
            sync(device)
            seconds.append(time.perf_counter() - start)
            rows.append(out.logits[:, -1].float().cpu().numpy())
    return np.stack(rows, axis=1), float(np.median(seconds)) if seconds else float("nan")
