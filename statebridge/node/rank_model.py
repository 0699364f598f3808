"""The real model on a rank: a :class:`~statebridge.models.runner.ModelRunner` over the rank's
page cache, behind the connector's :class:`~statebridge.connector.rank.RankModel` hook.

Runs inside each rank process, on the device its pages and KV pool are in (the rank's memory,
from ``setup.device``: weights follow them). TP > 1 joins a ``torch.distributed`` group at
``setup.dist_init`` so row-parallel outputs are all-reduced: gloo on the CPU and where ranks
share a GPU, NCCL where each rank has its own (:func:`statebridge.devices.tp_backend`).
"""

from __future__ import annotations

import logging

import torch

from statebridge.connector.rank import RankModel, RankSetup
from statebridge.errors import FailureKind
from statebridge.node import messages as nm
from statebridge.state.cache import StateCache

log = logging.getLogger(__name__)

__all__ = ["ModelRankModel", "sample_tokens"]


def sample_tokens(logits: torch.Tensor, msg: nm.RankStep) -> tuple[int, ...]:
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

    def __init__(self, setup: RankSetup, cache: StateCache, kv=None) -> None:
        super().__init__(setup, cache, kv)
        from statebridge.models.runner import ModelRunner

        self.device = cache.buffer.device
        if self.device.type == "cpu":
            # Several rank processes share the CPUs; torch's default of one thread per core in
            # every process makes them fight (docs/measurements.md, "Transport choices").
            torch.set_num_threads(setup.config.torch_threads)
        else:
            torch.cuda.set_device(self.device)
        self.process_group = None
        all_reduce = None
        if setup.tp_size > 1:
            from statebridge.devices import tp_backend
            from statebridge.models.distributed import init_tp_group

            # A private group rendezvousing at setup.dist_init (rank 0 hosts the store), so several
            # TP groups can live in one process (rank hosts in tests/benchmarks). Collectives keep
            # torch's 30 min bound: a rank's first kernel compile may hold one for minutes.
            self.process_group = init_tp_group(
                setup.tp_size, setup.tp_rank, setup.dist_init, device=self.device,
                backend=tp_backend(setup.device if self.device.type == "cuda" else "cpu",
                                   setup.tp_size),
                timeout_s=setup.config.handshake_timeout * 6, collective_timeout_s=30 * 60.0)
            all_reduce = self.process_group.all_reduce
        self.runner = ModelRunner(setup.model_dir, setup.tp_size, setup.tp_rank, cache, kv=kv,
                                  all_reduce=all_reduce)
        log.info("%s rank %d: model %s loaded", setup.role, setup.tp_rank, setup.model_dir)

    def prefill(self, page: int, prompt: tuple[int, ...], request_id: str,
                blocks: tuple[int, ...] = ()) -> None:
        with torch.inference_mode():
            self.runner.prefill([list(prompt)], [page],
                                blocks=[blocks] if self.runner.has_attention else None)
        if self.device.type == "cuda":
            # The state must be in memory before the rank says it is final: a same-host reader
            # gathers it, and UCX reads it, on streams of their own.
            torch.cuda.current_stream(self.device).synchronize()

    @classmethod
    def validate(cls, model_dir: str, tp_size: int) -> None:
        from statebridge.node.checks import check_weights

        check_weights(model_dir, tp_size)

    def handlers(self) -> dict:
        return {nm.RankStep: self.step}

    def step(self, msg: nm.RankStep) -> nm.RankStepResult | None:
        """One decode step of the batch on this rank; rank 0 samples and answers (a failure
        is answered by every rank: the node fails the batch on the first)."""
        try:
            with torch.inference_mode():
                logits = self.runner.decode(
                    list(msg.tokens), list(msg.pages), positions=msg.positions,
                    blocks=msg.blocks if self.runner.has_attention else None)
            if self.setup.tp_rank != 0:
                return None
            tokens = sample_tokens(logits, msg)
        except Exception as e:  # noqa: BLE001 -- the step fails, the rank serves on
            log.exception("rank %d: decode step %d failed", self.setup.tp_rank, msg.step)
            return nm.RankStepResult(step=msg.step, tp_rank=self.setup.tp_rank, tokens=(),
                                     kind=FailureKind.TRANSFER_ERROR.value,
                                     message=f"{type(e).__name__}: {e}")
        return nm.RankStepResult(step=msg.step, tp_rank=self.setup.tp_rank, tokens=tokens,
                                 kind="", message="")

    def close(self) -> None:
        self.process_group = None

