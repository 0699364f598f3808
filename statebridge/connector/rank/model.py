"""A rank's extension points, the types the rank package and its users share: the model hook
(:class:`RankModel`, with :class:`PrefillChunk`), what a rank process is started with
(:class:`RankSetup`), its KV block pool (:class:`KVBlocks`, :func:`kv_checksum`) and
:func:`load_callable`. Re-exported by :mod:`statebridge.connector.rank`; the rank's modules
(``worker``, ``compute``) import them from here, below the package's entry point."""

from __future__ import annotations

import hashlib
import importlib
import logging
from dataclasses import dataclass, field
from typing import Callable

import torch

from statebridge.config import ConnectorConfig
from statebridge.connector import messages as m
from statebridge.errors import ConfigError, StatebridgeError
from statebridge.state.cache import StateCache
from statebridge.state.kv import BlockGeometry

# The package's logger, as before these types had a module of their own.
log = logging.getLogger("statebridge.connector.rank")

__all__ = ["KVBlocks", "PrefillChunk", "RankModel", "RankSetup", "kv_checksum", "load_callable"]


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """One request's share of a prefill step: ``tokens``, its prompt's tokens
    ``[start, start + len(tokens))``; ``last`` when they end the prompt (its state is final
    after this step). ``blocks`` is the request's whole KV block table (empty without KV)."""

    request_id: str
    page: int
    tokens: tuple[int, ...]
    start: int = 0
    last: bool = True
    blocks: tuple[int, ...] = ()


class RankModel:
    """What runs on a rank's compute thread: the model (or a stand-in). A rank started without
    one (``RankSetup.model`` empty) runs this base class: it moves state, computes none.

    ``prefill`` writes the state of ``prompt`` into ``page`` of the rank's cache (and, for a
    spec with attention KV, its K and V into the request's ``blocks`` of :attr:`kv`);
    ``prefill_chunks`` runs one prefill step of several requests (by default, ``prefill`` per
    request) and ``agree_max`` lets the group's ranks agree on what a step holds. ``handlers``
    names further coordinator messages the model serves (e.g. a decode step): each handler
    returns the reply to send to the coordinator, or None. Everything runs in arrival order on
    every rank of the group, so collective ops across ranks line up.
    """

    def __init__(self, setup: "RankSetup", cache: StateCache,
                 kv: "KVBlocks | None" = None) -> None:
        self.setup = setup
        self.cache = cache
        #: The rank's transfer counters, for models that report on their rank: a snapshot
        #: (any thread) of its transport's counters and ``pending`` / ``computing`` requests
        #: (set by the rank after construction; :meth:`RankWorker.stats`).
        self.rank_stats: Callable[[], dict] = dict
        #: The rank's KV block pool (None for a spec without KV).
        self.kv: "KVBlocks | None" = kv

    def prefill(self, page: int, prompt: tuple[int, ...], request_id: str,
                blocks: tuple[int, ...] = ()) -> None:
        """Write the state after ``prompt`` into ``page`` and, for a spec with KV, the K and V
        of its ``len(prompt)`` tokens into ``blocks`` of :attr:`kv` (logical block i is
        ``blocks[i]``; the table covers the prompt). Runs on the compute thread.

        This base class is the rank without a model (``RankSetup.model`` empty): it refuses."""
        raise ConfigError(f"{self.setup.role} rank {self.setup.tp_rank} has no model "
                          f"(RankSetup.model is empty) to compute {request_id!r}")

    #: Whether :meth:`prefill_chunks` takes parts of prompts (``start > 0`` or not ``last``).
    #: False: the compute thread hands it whole prompts only.
    chunked_prefill = False

    def prefill_chunks(self, chunks: "list[PrefillChunk]") -> "list[str | None]":
        """Run one prefill step: several requests' chunks (whole prompts unless
        :attr:`chunked_prefill`), in one forward where the model can. Returns, per chunk, None
        or why it failed: a chunk that cannot run fails its request alone where the model can
        tell (e.g. a token outside the vocabulary), else the whole step fails. Runs on the
        compute thread; every rank of the group runs the same steps in the same order.

        This base runs :meth:`prefill` per chunk (each one failing alone)."""
        errors: list[str | None] = []
        for chunk in chunks:
            try:
                self.prefill(chunk.page, chunk.tokens, chunk.request_id, chunk.blocks)
                errors.append(None)
            except Exception as e:  # noqa: BLE001 -- the model failed: this request fails
                log.exception("%s rank %d: computing %s failed", self.setup.role,
                              self.setup.tp_rank, chunk.request_id)
                errors.append(f"prefill failed: {type(e).__name__}: {e}")
        return errors

    def agree_max(self, values: "list[int]") -> "list[int]":
        """The elementwise maximum of ``values`` over the ranks of the group (every rank calls
        it with as many values, at the same point of its work). The compute thread agrees this
        way on what the next prefill step holds, which depends on when each rank's messages
        arrived, so that collective ops line up. This base (no collectives): ``values``."""
        return list(values)

    @classmethod
    def validate(cls, model_dir: str, tp_size: int) -> None:
        """Called in the node's process before any rank starts: raise a typed error naming
        the value if ``model_dir`` cannot be served at ``tp_size`` (nothing to check here)."""

    def weight_memory(self) -> tuple[int, int]:
        """(private, file-mapped) bytes this rank's model holds beside the rank buffer, as the
        process sees them (reported to the node at start; this base class: none)."""
        return 0, 0

    def handlers(self) -> "dict[type, Callable[[m.Message], m.Message | None]]":
        """Message type -> handler, run on the compute thread. A handler that raises is
        logged and answered with nothing: handlers report their own failures."""
        return {}

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class RankSetup:
    """Everything a rank process needs to start (picklable: it crosses a process spawn)."""

    role: str                      # "prefill" | "decode"
    coordinator: str               # host:port of the group coordinator's ROUTER
    tp_rank: int
    tp_size: int
    spec_json: str
    layout: str
    num_pages: int
    node_id: str
    config: ConnectorConfig = field(default_factory=ConnectorConfig)
    region_align: int = 16
    #: ``module:Class`` of the rank's :class:`RankModel`; "" (the default): none -- the rank
    #: moves state and computes nothing (a prefill fails naming this field).
    model: str = ""
    model_dir: str = ""                                         # checkpoint, for real models
    dist_init: str = ""                                         # torch.distributed rendezvous
    #: The instrumentation switch: one of ``messages.PROBES`` ("": off, the product);
    #: what it turns on is written in ONE place, :class:`~statebridge.connector.messages.RankProbe`.
    probes: str = ""
    log_level: str = ""                                         # "": leave logging alone
    kv_layout: str = "HB"                                       # KV block pool (spec.kv)
    block_size: int = 16
    num_blocks: int = 0                                         # 0: no KV pool
    #: The coordinator's local channel (connector/local.py), used instead of ``coordinator``
    #: when set: ranks always run on their coordinator's machine.
    local_coordinator: str = ""
    #: Where the rank computes and holds its pages and KV pool: the node's ``--device``
    #: (:mod:`statebridge.devices`: auto | cpu | cuda | cuda:N), resolved in the rank for its
    #: ``tp_rank``.
    device: str = "cpu"
    #: The coordinator's process id: the rank exits when that process is gone (0: the rank's
    #: parent at start, which is the coordinator for spawned ranks).
    coordinator_pid: int = 0
    #: ``UCX_NET_DEVICES`` of the rank's UCX worker (its TCP listeners): the interface of the
    #: node's bind address (:func:`statebridge.connector.data.env.ucx_net_devices`); "" leaves
    #: UCX's default, every interface.
    ucx_net_devices: str = ""


class KVBlocks:
    """A rank's KV block pool: its geometry and its bytes (the part of the rank's one
    registered buffer after the pages, from byte ``base`` on)."""

    def __init__(self, geometry: BlockGeometry, buffer: torch.Tensor, base: int) -> None:
        self.geometry = geometry
        self.buffer = buffer
        self.base = base

    def view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of attention layer ``layer``: ``[blocks, heads, block_size, head_dim]``."""
        return self.geometry.view(self.buffer, layer)


def kv_checksum(kv: KVBlocks, blocks, tokens: int) -> str:
    """blake2b of a request's K and V on one rank: per attention layer, K then V, of the
    first ``tokens`` tokens in token order (``[tokens, local heads, head_dim]`` bytes), read
    through the block table ``blocks`` -- whatever the layout. Slots of the last block past
    ``tokens`` are not covered (nothing defines them: the decode side overwrites them before
    it reads them)."""
    geo = kv.geometry
    h = hashlib.blake2b(digest_size=16)
    idx = torch.as_tensor(list(blocks), dtype=torch.int64, device=kv.buffer.device)
    for layer in range(geo.kv.num_layers):
        for t in kv.view(layer):
            x = t[idx].permute(0, 2, 1, 3).reshape(-1, geo.heads, geo.kv.head_dim)[:tokens]
            h.update(x.contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def load_callable(name: str) -> Callable:
    module, _, attr = name.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise StatebridgeError(f"cannot load {name!r}: {e}") from None
