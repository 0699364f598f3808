"""What a node checks in its own process before it starts any rank: the checkpoint.

A missing weight file, a weight of the wrong shape, a config the model cannot be split for at
this TP size -- each is a typed error naming the value, raised in the node's process at once,
instead of N rank processes failing one by one after seconds of start-up. What is checked
depends on the rank model: :meth:`RankModel.validate
<statebridge.connector.rank.RankModel.validate>` (the real model checks every weight; a
stand-in checks nothing).
"""

from __future__ import annotations

import os

from statebridge.connector.rank import load_callable
from statebridge.state.spec import StateSpec

__all__ = ["check_checkpoint", "check_weights"]


def check_checkpoint(model_dir: str | os.PathLike, tp_size: int, rank_model: str) -> StateSpec:
    """The state spec of the checkpoint at ``model_dir`` (from ``config.json``), after
    ``rank_model``'s own check of what every rank will load."""
    spec = StateSpec.from_pretrained(model_dir)
    validate = getattr(load_callable(rank_model), "validate", None)
    if validate is not None:
        validate(str(model_dir), tp_size)
    return spec


def check_weights(model_dir: str | os.PathLike, tp_size: int) -> None:
    """Check what every rank of a real model loads: the weight index or file, every weight's
    presence, shape and dtype, every weight file, and that ``tp_size`` splits the model
    (ConfigError / UnsupportedModelError / ShapeError naming the value otherwise)."""
    from statebridge.models.checkpoint import Checkpoint
    from statebridge.models.runner import check_tp_size

    with Checkpoint(model_dir) as ckpt:
        check_tp_size(ckpt.config, tp_size)
        ckpt.check(ckpt.config.weight_shapes())
        for filename in ckpt.files():
            ckpt.open_file(filename)              # every shard exists and is safetensors
