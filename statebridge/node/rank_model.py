"""The real model on a rank: a :class:`~statebridge.models.runner.ModelRunner` over the rank's
page cache, behind the connector's :class:`~statebridge.connector._rank.RankModel` hook.

Runs inside each rank process; TP > 1 joins a ``torch.distributed`` group (gloo on CPU, nccl on
CUDA) at ``setup.dist_init`` so row-parallel outputs are all-reduced.
"""

from __future__ import annotations

import logging

import torch

from statebridge.connector import messages as m
from statebridge.connector._rank import RankModel, RankSetup
from statebridge.state.cache import StateCache

log = logging.getLogger(__name__)

__all__ = ["ModelRankModel", "sample_tokens"]


def sample_tokens(logits: torch.Tensor, msg: m.RankStep) -> tuple[int, ...]:
    """One token per row: greedy at temperature 0, else temperature + top-p with a generator
    seeded by (request seed, position) so a request's tokens do not depend on its batch."""
    from statebridge.models.sampling import sample

    out = []
    for i in range(logits.shape[0]):
        row = logits[i:i + 1].float()
        if msg.temperatures[i] <= 0:
            out.append(int(row.argmax(dim=-1)))
            continue
        gen = torch.Generator().manual_seed((msg.seeds[i] * 1_000_003 + msg.positions[i])
                                            & 0x7FFF_FFFF_FFFF_FFFF)
        out.append(int(sample(row, msg.temperatures[i], msg.top_ps[i], gen)[0]))
    return tuple(out)


class ModelRankModel(RankModel):
    """Prefill (prefill node, and the decode node's recompute policy) and decode steps."""

    def __init__(self, setup: RankSetup, cache: StateCache) -> None:
        super().__init__(setup, cache)
        from statebridge.models.runner import ModelRunner

        self.group_initialised = False
        all_reduce = None
        if setup.tp_size > 1:
            import torch.distributed as dist

            backend = "nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend, init_method=setup.dist_init,
                                    world_size=setup.tp_size, rank=setup.tp_rank)
            self.group_initialised = True

            def all_reduce(t: torch.Tensor) -> torch.Tensor:
                dist.all_reduce(t)
                return t
        self.runner = ModelRunner(setup.model_dir, setup.tp_size, setup.tp_rank, cache,
                                  all_reduce=all_reduce)
        log.info("%s rank %d: model %s loaded", setup.role, setup.tp_rank, setup.model_dir)

    def prefill(self, page: int, prompt: tuple[int, ...], request_id: str) -> None:
        with torch.inference_mode():
            self.runner.prefill([list(prompt)], [page])

    def step(self, msg: m.RankStep) -> tuple[int, ...] | None:
        with torch.inference_mode():
            logits = self.runner.decode(list(msg.tokens), list(msg.pages))
        if self.setup.tp_rank != 0:
            return None
        return sample_tokens(logits, msg)

    def close(self) -> None:
        if self.group_initialised:
            import torch.distributed as dist

            try:
                dist.destroy_process_group()
            except Exception:  # already torn down by a dying peer
                pass
