"""Language models at the shapes of released checkpoints, for random-weight stand-ins.

``ssmserve model init-demo DIR --preset NAME`` writes one in Hugging Face format
(``config.json`` + ``model.safetensors``, F32) so benchmarks and tests run at real sizes
on a machine with no model hub. The dims are those of the state-spaces checkpoints'
``config.json``; the weights are random (``demo.random_tensors``), so the outputs mean
nothing, but every cost (products, scan, state bytes, checkpoint size) is the real one.

=============  ======  ======  =====  =====  =========  =======================
preset         d       layers  n      vocab  params     state per session
=============  ======  ======  =====  =====  =========  =======================
mamba-130m     768     24      16     50280  129 M      2.8 MiB (conv + ssm)
mamba2-130m    768     24      128    50288  129 M      18.7 MiB
mamba-790m     1536    48      16     50280  793 M      11.3 MiB
=============  ======  ======  =====  =====  =========  =======================

mamba2-130m's embedding rows are its tokenizer's 50277 padded to a multiple of 16, as
its checkpoint (and llama.cpp's converter) has them.
"""

from __future__ import annotations

import math

from ssmserve.server.engine.config import Architecture, MambaConfig


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


def _mamba2(hidden: int, layers: int, vocab: int) -> MambaConfig:
    """A state-spaces Mamba-2 LM: state 128, head dim 64, 1 group, expand 2, conv 4."""
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
        n_groups=1,
    )


#: Preset name -> its config.
PRESETS: dict[str, MambaConfig] = {
    "mamba-130m": _mamba1(768, 24, 50280),
    "mamba2-130m": _mamba2(768, 24, 50288),
    "mamba-790m": _mamba1(1536, 48, 50280),
}


def preset_config(name: str) -> MambaConfig:
    """The config of preset ``name``; ``ValueError`` naming the presets for any other."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; one of {', '.join(PRESETS)}") from None
