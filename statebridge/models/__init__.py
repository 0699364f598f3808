"""A small tensor-parallel runtime for Hugging Face checkpoints of LFM2 (ShortConv layers) and
Mamba2, whose recurrent state lives only in :class:`~statebridge.state.cache.StateCache` pages.

- :mod:`~statebridge.models.checkpoint`: read one rank's shard of a checkpoint; write random ones.
- :mod:`~statebridge.models.runner`: :class:`ModelRunner` (prefill / decode / reset on pages).
- :mod:`~statebridge.models.distributed`: the TP group (torch.distributed, threads, or none).
- :mod:`~statebridge.models.sampling`: greedy / temperature / top-p sampling.

Depends on :mod:`statebridge.kernels` and :mod:`statebridge.state`; never imports transformers.
"""

from statebridge.models.checkpoint import PRESETS, Checkpoint, LazyTensor, make_checkpoint
from statebridge.models.distributed import (
    ThreadGroup,
    TPGroup,
    init_tp_group,
    make_all_reduce,
)
from statebridge.models.hf_config import ModelConfig, lfm2_ff_dim
from statebridge.models.runner import ModelRunner
from statebridge.models.sampling import greedy, sample

__all__ = [
    "ModelRunner",
    "Checkpoint",
    "LazyTensor",
    "make_checkpoint",
    "PRESETS",
    "ModelConfig",
    "lfm2_ff_dim",
    "TPGroup",
    "init_tp_group",
    "make_all_reduce",
    "ThreadGroup",
    "sample",
    "greedy",
]
