"""A small tensor-parallel runtime for Hugging Face checkpoints of LFM2 (ShortConv layers) and
Mamba2, whose recurrent state lives only in :class:`~statebridge.state.cache.StateCache` pages.

- :mod:`~statebridge.models.checkpoint`: read one rank's shard of a checkpoint; write random ones.
- :mod:`~statebridge.models.runner`: :class:`ModelRunner` (prefill / decode / reset on pages).
- :mod:`~statebridge.models.tp`: every TP slice of a weight; the mixers built from the slices.
- :mod:`~statebridge.models.distributed`: the TP group (torch.distributed, threads, or none).
- :mod:`~statebridge.models.sampling`: greedy / temperature / top-p sampling.

``config.json`` is read by :class:`~statebridge.hf_config.ModelConfig` (re-exported here), the
reader the state spec uses too.

Depends on :mod:`statebridge.kernels` and :mod:`statebridge.state`; never imports transformers.
"""

from statebridge.hf_config import ModelConfig
from statebridge.models.checkpoint import PRESETS, Checkpoint, LazyTensor, make_checkpoint
from statebridge.models.distributed import (
    Rendezvous,
    ThreadGroup,
    TPGroup,
    init_tp_group,
    make_all_reduce,
)
from statebridge.models.runner import ModelRunner
from statebridge.models.sampling import greedy, sample

__all__ = [
    "ModelRunner",
    "Checkpoint",
    "LazyTensor",
    "make_checkpoint",
    "PRESETS",
    "ModelConfig",
    "TPGroup",
    "Rendezvous",
    "init_tp_group",
    "make_all_reduce",
    "ThreadGroup",
    "sample",
    "greedy",
]
