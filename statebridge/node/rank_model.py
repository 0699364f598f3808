"""The real model on a rank: a :class:`~statebridge.models.runner.ModelRunner` over the rank's
page cache, behind the connector's :class:`~statebridge.connector.rank.RankModel` hook.

Runs inside each rank process, on the device its pages and KV pool are in (the rank's memory,
from ``setup.device``: weights follow them). TP > 1 joins a ``torch.distributed`` group at
``setup.dist_init`` so row-parallel outputs are all-reduced: gloo on the CPU and where ranks
share a GPU, NCCL where each rank has its own (:func:`statebridge.devices.tp_backend`).
"""

from __future__ import annotations

import logging
import math
from typing import Sequence

import torch

from statebridge.connector.rank import PrefillChunk, RankModel, RankSetup
from statebridge.errors import FailureKind, StatebridgeError
from statebridge.node import messages as nm
from statebridge.state.cache import StateCache

log = logging.getLogger(__name__)

__all__ = ["ModelRankModel", "sample_tokens", "sample_row", "step_logprobs"]


def sample_tokens(logits: torch.Tensor, msg: nm.RankStep,
                  rows: Sequence[int] | None = None) -> tuple[int, ...]:
    """One token per row: greedy below ``MIN_TEMPERATURE``, else temperature + top-p with a
    generator seeded by (request seed, position) so a request's tokens do not depend on its
    batch. ``logits`` row ``i`` belongs to request row ``rows[i]`` of ``msg`` (default: the
    same row). A row whose values cannot be sampled raises for the whole call; the decode
    step samples row by row (:func:`sample_row`) so such a row fails alone."""
    rows = range(logits.shape[0]) if rows is None else rows
    return tuple(sample_row(logits[i:i + 1], msg, row) for i, row in enumerate(rows))


def sample_row(logits: torch.Tensor, msg: nm.RankStep, row: int) -> int:
    """The token of request row ``row`` of ``msg`` from its ``[1, V]`` logits."""
    from statebridge.models.sampling import MIN_TEMPERATURE, sample

    logits = logits.float()
    if msg.temperatures[row] < MIN_TEMPERATURE:
        return int(logits.argmax(dim=-1))
    gen = torch.Generator().manual_seed((msg.seeds[row] * 1_000_003 + msg.positions[row])
                                        & 0x7FFF_FFFF_FFFF_FFFF)
    return int(sample(logits, msg.temperatures[row], msg.top_ps[row], gen)[0])


def step_logprobs(logits: torch.Tensor | None, msg: nm.RankStep, rows: Sequence[int],
                  tokens: Sequence[int], failed: dict) -> dict:
    """The log-probability fields of a step's RankStepResult: empty unless a row asked
    (``msg.logprobs``); then per row the sampled token's and the top ones of the raw logits
    (NaN and empty for a row that did not ask or failed). Only the rows that asked pay."""
    if len(msg.logprobs) != len(msg.tokens) or logits is None:
        return {}
    from statebridge.models.sampling import token_logprobs

    n = len(msg.tokens)
    chosen, top_ids, top_lps = [math.nan] * n, [()] * n, [()] * n
    for i, row in enumerate(rows):
        k = msg.logprobs[row]
        if k < 0 or row in failed:
            continue
        chosen[row], top_ids[row], top_lps[row] = token_logprobs(logits[i], tokens[row], k)
    return {"logprobs": tuple(chosen), "top_ids": tuple(top_ids),
            "top_logprobs": tuple(top_lps)}


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
        from statebridge.connector.rank.startup import (
            WeightProgress,
            fmt_bytes,
            phase,
            release_free_heap,
        )
        from statebridge.models.checkpoint import observe_reads

        who = f"{setup.role} rank {setup.tp_rank}"
        self.process_group = None
        all_reduce = None
        if setup.tp_size > 1:
            from statebridge.devices import tp_backend
            from statebridge.models.distributed import init_tp_group

            # A private group rendezvousing at setup.dist_init (rank 0 hosts the store), so several
            # TP groups can live in one process (rank hosts in tests/benchmarks). Collectives keep
            # torch's 30 min bound: a rank's first kernel compile may hold one for minutes.
            with phase(who, f"rendezvous of TP {setup.tp_size}"):
                self.process_group = init_tp_group(
                    setup.tp_size, setup.tp_rank, setup.dist_init, device=self.device,
                    backend=tp_backend(setup.device if self.device.type == "cuda" else "cpu",
                                       setup.tp_size),
                    timeout_s=setup.config.handshake_timeout * 6, collective_timeout_s=30 * 60.0)
            all_reduce = self.process_group.all_reduce
        with phase(who, f"weights from {setup.model_dir}") as p, \
                WeightProgress(who, tp_rank=setup.tp_rank) as progress, observe_reads(progress):
            self.runner = ModelRunner(setup.model_dir, setup.tp_size, setup.tp_rank, cache,
                                      kv=kv, all_reduce=all_reduce)
            p.detail = f"{fmt_bytes(progress.nbytes)} read"
        release_free_heap()             # the loading's freed temporaries leave the RSS

    def weight_memory(self) -> tuple[int, int]:
        """(private, mapped) bytes of the weights in this rank process: the distinct tensor
        storages the runner holds outside the checkpoint's file mappings (the rank buffer left
        out), and the resident pages of those mappings."""
        from statebridge.connector.rank.startup import weight_memory

        exclude = (self.cache.buffer,) + ((self.kv.buffer,) if self.kv is not None else ())
        return weight_memory(self.runner, self.setup.model_dir, exclude=exclude)

    #: The runner continues a prompt from its page (and its KV blocks): chunks are fine.
    chunked_prefill = True

    def prefill(self, page: int, prompt: tuple[int, ...], request_id: str,
                blocks: tuple[int, ...] = ()) -> None:
        with torch.inference_mode():
            self.runner.prefill([list(prompt)], [page],
                                blocks=[blocks] if self.runner.has_attention else None)
        if self.device.type == "cuda":
            # The state must be in memory before the rank says it is final: a same-host reader
            # gathers it, and UCX reads it, on streams of their own.
            torch.cuda.current_stream(self.device).synchronize()

    def prefill_chunks(self, chunks: Sequence[PrefillChunk]) -> list[str | None]:
        """One varlen forward of every chunk. A chunk with a token id outside the vocabulary
        fails alone (every rank leaves out the same chunks: they all see the same step); a
        forward that raises fails the step (the compute thread fails each of its requests)."""
        vocab = self.runner.vocab_size
        errors: list[str | None] = [None] * len(chunks)
        for i, chunk in enumerate(chunks):
            bad = next((t for t in chunk.tokens if not 0 <= t < vocab), None)
            if bad is not None:
                errors[i] = (f"prefill failed: token id {bad} is outside the vocabulary of "
                             f"{vocab}")
        rows = [chunk for chunk, error in zip(chunks, errors) if error is None]
        if rows:
            with torch.inference_mode():
                self.runner.prefill([c.tokens for c in rows], [c.page for c in rows],
                                    starts=[c.start for c in rows],
                                    blocks=[c.blocks for c in rows]
                                    if self.runner.has_attention else None)
        return errors

    def agree_max(self, values: list[int]) -> list[int]:
        """Elementwise maximum over the TP group (one small all-reduce; itself at TP 1)."""
        if self.process_group is None:
            return list(values)
        import torch.distributed as dist

        tensor = torch.tensor(values, dtype=torch.int64, device=self.runner.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        self.process_group.process_group.allreduce([tensor], opts).wait()
        return tensor.tolist()

    @classmethod
    def validate(cls, model_dir: str, tp_size: int) -> None:
        from statebridge.node.checks import check_weights

        check_weights(model_dir, tp_size)

    def handlers(self) -> dict:
        return {nm.RankStep: self.step}

    def step(self, msg: nm.RankStep) -> nm.RankStepResult | None:
        """One decode step of the batch on this rank; rank 0 samples and answers.

        A row that cannot be served fails alone: a token id outside the vocabulary is left
        out of the forward pass (every rank leaves out the same rows: they all see the same
        step), a row whose values cannot be sampled gets no token; both are reported as
        ``invalid_request`` in ``failed_rows``. A forward pass that raises fails the whole
        step as ``internal`` (the states of its batch may be half updated), answered by
        every rank: the node fails the batch on the first."""
        vocab = self.runner.vocab_size
        failed: dict[int, tuple[str, str]] = {}
        for row, token in enumerate(msg.tokens):
            if not 0 <= token < vocab:
                failed[row] = (FailureKind.INVALID_REQUEST.value,
                               f"token id {token} is outside the vocabulary of {vocab}")
        rows = [row for row in range(len(msg.tokens)) if row not in failed]
        try:
            logits = None
            if rows:
                every = len(rows) == len(msg.tokens)
                with torch.inference_mode():
                    logits = self.runner.decode(
                        list(msg.tokens) if every else [msg.tokens[r] for r in rows],
                        list(msg.pages) if every else [msg.pages[r] for r in rows],
                        positions=msg.positions if every else
                        tuple(msg.positions[r] for r in rows),
                        blocks=None if not self.runner.has_attention else
                        msg.blocks if every else tuple(msg.blocks[r] for r in rows))
            if self.setup.tp_rank != 0:
                return None
        except Exception as e:  # noqa: BLE001 -- the step fails, the rank serves on
            log.exception("rank %d: decode step %d failed", self.setup.tp_rank, msg.step)
            return nm.RankStepResult(step=msg.step, tp_rank=self.setup.tp_rank, tokens=(),
                                     kind=FailureKind.INTERNAL.value,
                                     message=f"{type(e).__name__}: {e}")
        tokens = [-1] * len(msg.tokens)
        for i, row in enumerate(rows):
            try:
                tokens[row] = sample_row(logits[i:i + 1], msg, row)
            except StatebridgeError as e:       # this row's values (ConfigError, ShapeError)
                failed[row] = (FailureKind.INVALID_REQUEST.value, f"sampling: {e}")
            except Exception as e:  # noqa: BLE001 -- this row fails, the others are served
                log.exception("rank 0: sampling row %d of step %d failed", row, msg.step)
                failed[row] = (FailureKind.INTERNAL.value,
                               f"sampling: {type(e).__name__}: {e}")
        if failed:
            log.warning("decode step %d: %d of %d rows failed: %s", msg.step, len(failed),
                        len(msg.tokens), "; ".join(f"{msg.request_ids[r]}: {why}"
                                                  for r, (_, why) in sorted(failed.items())))
        order = sorted(failed)
        return nm.RankStepResult(step=msg.step, tp_rank=self.setup.tp_rank,
                                 tokens=tuple(tokens), kind="", message="",
                                 failed_rows=tuple(order),
                                 failed_kinds=tuple(failed[r][0] for r in order),
                                 failed_messages=tuple(failed[r][1] for r in order),
                                 **step_logprobs(logits, msg, rows, tokens, failed))

    def close(self) -> None:
        self.process_group = None

