"""Language models at the shapes of released checkpoints, for random-weight stand-ins.

``ssmserve model init-demo DIR --preset NAME`` writes one in Hugging Face format
(``config.json`` + ``model.safetensors``) so benchmarks and tests run at real sizes on a
machine with no model hub. The dims are those of each checkpoint's ``config.json``; the
weights are random, so the outputs mean nothing, but every cost (products, scan, state
bytes, checkpoint size, memory) is the real one.

==================  =====  ======  ===  =====  =======  =========  ======================
preset              d      layers  n    vocab  params   state      stored
                                                        /session
==================  =====  ======  ===  =====  =======  =========  ======================
mamba-130m          768    24      16   50280  129 M    2.8 MiB    F32, 0.52 GB
mamba2-130m         768    24      128  50288  129 M    18.7 MiB   F32, 0.52 GB
mamba-790m          1536   48      16   50280  793 M    11.3 MiB   F32, 3.17 GB
mamba-2.8b          2560   64      16   50280  2,768 M  25.0 MiB   BF16, 5.54 GB
falcon-mamba-7b     4096   64      16   65024  7,273 M  40.0 MiB   BF16, 14.55 GB
mamba-codestral-7b  4096   64      128  32768  7,285 M  266.0 MiB  BF16, 14.57 GB
==================  =====  ======  ===  =====  =======  =========  ======================

State per session: every layer's conv window and SSM state, float32
(``MambaConfig.state_bytes``). Stored: ``model.safetensors`` (GB = 10^9 bytes). The F32
presets are written whole from ``demo.random_tensors``; the BF16 ones, which are bigger
than a machine may hold as float32 (28 GB for a 7B), one tensor at a time
(``demo.random_tensor`` into ``loader.save_model_streamed``), so writing one takes the
memory of its largest tensor, not of the model.

Where each shape comes from (the checkpoint's ``config.json``; copies of it in public code,
each field checked against transformers 5.24's config classes, which read it as the engine
does, in ``tests/test_presets.py``):

* mamba-130m, mamba-790m, mamba-2.8b: state-spaces/mamba-{130m,790m,2.8b}-hf
  (``MambaForCausalLM``: expand 2, state 16, conv 4, Δ rank ceil(d / 16), tied head; vocab
  50280, the tokenizer's 50277 padded to a multiple of 8). mamba-2.8b-hf: hidden 2560,
  intermediate 5120, 64 layers, Δ rank 160.
* mamba2-130m: state-spaces/mamba2-130m; its embedding rows are its tokenizer's 50277
  padded to a multiple of 16, as its checkpoint (and llama.cpp's converter) has them.
* falcon-mamba-7b: tiiuae/falcon-mamba-7b (``FalconMambaForCausalLM``): hidden 4096,
  ``intermediate_size`` 8192 (its ``expand`` says 16, but the explicit size wins, in
  transformers and here), 64 layers, state 16, conv 4, Δ rank 256, no biases but the
  conv's, vocab 65024, untied head, ``layer_norm_epsilon`` 1e-5; its config names no
  ``mixer_rms_eps``, so transformers' default 1e-6 applies (the mixer's weightless RMS
  norms of Δ, B and C).
* mamba-codestral-7b: mistralai/Mamba-Codestral-7B-v0.1 (``Mamba2ForCausalLM``): hidden
  4096, expand 2, 128 heads of 64, 8 groups, state 128, conv 4, 64 layers, vocab 32768,
  untied head, ``time_step_limit`` (0, inf), ``layer_norm_epsilon`` 1e-5.
"""

from __future__ import annotations

import dataclasses
import math

from ssmserve.server.engine.config import Architecture, MambaConfig
from ssmserve.server.engine.loader import weights_file_bytes
from ssmserve.server.engine.model_tensors import expected_shapes, load_bytes


def _mamba1(hidden: int, layers: int, vocab: int) -> MambaConfig:
    """A state-spaces Mamba-1 LM: state 16, expand 2, conv 4, Δ rank d / 16, tied head."""
    return MambaConfig(
        architecture=Architecture.LM,
        hidden_size=hidden,
        state_size=16,
        num_hidden_layers=layers,
        intermediate_size=2 * hidden,
        conv_kernel=4,
        time_step_rank=math.ceil(hidden / 16),
        use_bias=False,
        use_conv_bias=True,
        layer_norm_epsilon=1e-5,
        vocab_size=vocab,
        tie_word_embeddings=True,
    )


def _mamba2(hidden: int, layers: int, vocab: int, groups: int = 1) -> MambaConfig:
    """A Mamba-2 LM: state 128, head dim 64, expand 2, conv 4 (state-spaces': 1 group)."""
    head_dim = 64
    return MambaConfig(
        architecture=Architecture.MAMBA2_LM,
        hidden_size=hidden,
        state_size=128,
        num_hidden_layers=layers,
        intermediate_size=2 * hidden,
        conv_kernel=4,
        time_step_rank=0,
        use_bias=False,
        use_conv_bias=True,
        layer_norm_epsilon=1e-5,
        vocab_size=vocab,
        tie_word_embeddings=True,
        num_heads=2 * hidden // head_dim,
        head_dim=head_dim,
        n_groups=groups,
    )


#: Preset name -> its config.
PRESETS: dict[str, MambaConfig] = {
    "mamba-130m": _mamba1(768, 24, 50280),
    "mamba2-130m": _mamba2(768, 24, 50288),
    "mamba-790m": _mamba1(1536, 48, 50280),
    "mamba-2.8b": _mamba1(2560, 64, 50280),
    "falcon-mamba-7b": dataclasses.replace(
        _mamba1(4096, 64, 65024), tie_word_embeddings=False, mixer_rms_eps=1e-6
    ),
    "mamba-codestral-7b": dataclasses.replace(
        _mamba2(4096, 64, 32768, groups=8), tie_word_embeddings=False
    ),
}

#: How ``init-demo`` stores each preset's weights: the small ones F32 (as they always
#: were: their fingerprints and figures stand), the big ones BF16, as released.
PRESET_DTYPES: dict[str, str] = {
    "mamba-130m": "F32",
    "mamba2-130m": "F32",
    "mamba-790m": "F32",
    "mamba-2.8b": "BF16",
    "falcon-mamba-7b": "BF16",
    "mamba-codestral-7b": "BF16",
}


def preset_config(name: str) -> MambaConfig:
    """The config of preset ``name``; ``ValueError`` naming the presets for any other."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; one of {', '.join(PRESETS)}") from None


@dataclasses.dataclass(frozen=True)
class PresetNeeds:
    """What writing and serving a preset takes, in bytes."""

    disk: int  # model.safetensors (config.json is a few hundred bytes more)
    memory: int  # loading it as stored (BF16 kept 16-bit): model_tensors.load_bytes
    memory_q8: int  # loading it with --quantize q8_0


def preset_needs(name: str) -> PresetNeeds:
    config, dtype = preset_config(name), PRESET_DTYPES[name]
    stored = dict.fromkeys(expected_shapes(config), dtype)
    return PresetNeeds(
        disk=weights_file_bytes(config, dtype),
        memory=load_bytes(config, stored, keep_bf16=True),
        memory_q8=load_bytes(config, stored, keep_bf16=True, quantize="q8_0"),
    )


class PresetDoesNotFit(ValueError):
    """A preset needs more disk or memory than the figures given show (message: both)."""


#: Disk left free beside a written preset (the filesystem's own room, logs, the Redis).
DISK_MARGIN = 1 << 30


def check_room(name: str, where: str, free_disk: int, available_memory: int | None) -> str:
    """Whether preset ``name`` can be written to ``where``, whose filesystem has
    ``free_disk`` bytes free, and served in ``available_memory`` bytes
    (``machine_memory.available_memory()``; None: unknown, not checked). Raises
    :class:`PresetDoesNotFit` with the figures when it would not fit on the disk, or could
    not be loaded here even with ``--quantize q8_0``; returns a note (else ``''``) when it
    fits in memory only with ``--quantize q8_0``. The figures are parameters so that the
    refusals are tested without filling a disk or the memory."""
    needs, dtype = preset_needs(name), PRESET_DTYPES[name]
    if needs.disk + DISK_MARGIN > free_disk:
        raise PresetDoesNotFit(
            f"preset {name} is {needs.disk / 1e9:.2f} GB on disk ({dtype}) and "
            f"{free_disk / 1e9:.2f} GB is free in {where}: it needs "
            f"{(needs.disk + DISK_MARGIN) / 1e9:.2f} GB free (the file and "
            f"{DISK_MARGIN / 1e9:.2f} GB to spare); free some space, or write it to another disk"
        )
    if available_memory is None or needs.memory <= available_memory:
        return ""
    figures = (
        f"preset {name} needs about {needs.memory / 2**30:.1f} GiB of memory to load as "
        f"stored ({dtype}, kept 16-bit) and {available_memory / 2**30:.1f} GiB is "
        f"available here"
    )
    if needs.memory_q8 <= available_memory:
        return (
            f"note: {figures}; with --quantize q8_0 (Q8_0 weights) it needs about "
            f"{needs.memory_q8 / 2**30:.1f} GiB, which fits: serve it with "
            f"`ssmserve-server --quantize q8_0`"
        )
    raise PresetDoesNotFit(
        f"{figures}, and about {needs.memory_q8 / 2**30:.1f} GiB even with --quantize "
        f"q8_0: it could not be served here; free memory, or write it on a machine with more"
    )
