"""ModelRunner: one tensor-parallel rank of an LFM2 (ShortConv and attention layers), Mamba2 or
dense GraniteMoeHybrid (Mamba2 and attention layers) model whose recurrent state lives ONLY in a
:class:`~statebridge.state.cache.StateCache` and whose attention KV lives ONLY in the rank's KV
block pool (:class:`~statebridge.connector.rank.KVBlocks`).

Every TP rank of a group builds one runner over its own cache and calls the same methods with
the same arguments in the same order (each call runs collectives through ``all_reduce``)::

    tokens -> embed (replicated)
           -> per layer:  norm -> mixer (column-parallel in_proj, sharded conv/SSM on the page
                          views or GQA attention on the KV block views, row-parallel out_proj)
                          -> all_reduce -> + residual
                          [LFM2, Granite] norm -> MLP (column- then row-parallel) -> all_reduce
           -> final norm -> lm_head (replicated) -> fp32 logits of the last token

Granite scales the embedding by ``embedding_multiplier``, each block's output by
``residual_multiplier`` and the logits by ``1 / logits_scaling``.

Weights are read from the HF checkpoint per rank (:class:`~statebridge.models.checkpoint.
Checkpoint`) and cut by :mod:`statebridge.models.tp`: sharded weights through lazy handles, so a
rank reads only its rows; embedding, norms and lm_head whole. Decoder layer ``i`` keeps its state
in the cache region of the layer group ``g`` that lists it, at index
``j = spec.groups[g].layer_ids.index(i)``; the kernels read and write those strided views
(``cache.view(g, tensor, j)``, any layout). Attention layer ``i`` keeps K and V in the KV pool
at index ``spec.kv.layer_ids.index(i)`` (``kv.view(...)``, any KV layout), addressed through
each request's block table. So a page and blocks filled by a transfer from another TP degree or
layout are all a decode needs.

Per step the host sends the device one small int64 tensor (token ids, pages, positions; for a
prefill also the sequence bounds and resume flags) and, only when some block table changed,
one tensor of the changed entries: block tables live on the device, one row per page (a
request's page names its row), and are updated in place (:class:`_DeviceBlockTables`). Tables
are checked on the host before they reach the device, so the kernels read nothing back.

Not thread-safe: one thread drives a runner.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from statebridge.dtypes import DTYPES, dtype_from_name
from statebridge.errors import CacheError, ConfigError, ShapeError
from statebridge.hf_config import GraniteHybridModelConfig, ModelConfig
from statebridge.kernels.layers import AttentionMixer, ShortConvMixer
from statebridge.models import tp
from statebridge.models.checkpoint import Checkpoint
from statebridge.state.cache import StateCache
from statebridge.state.kv import blocks_for
from statebridge.state.spec import StateSpec

if TYPE_CHECKING:
    from statebridge.connector.rank import KVBlocks

__all__ = ["ModelRunner", "AllReduce", "check_tp_size"]

log = logging.getLogger(__name__)

AllReduce = Callable[[torch.Tensor], torch.Tensor]
"""Sum over the TP group; may reuse its argument's storage; returns the sum."""


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm exactly as ``Lfm2RMSNorm`` / ``Mamba2RMSNorm`` (fp32 statistics)."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _spec_shape(spec: StateSpec) -> dict:
    """A spec's description without dtypes (a cache may store state in another dtype)."""
    d = spec.to_dict()
    for group in d["groups"]:
        for tensor in group["tensors"]:
            tensor.pop("dtype")
    return d


@dataclass
class _Layer:
    """One decoder layer on this rank."""

    index: int                    # HF layer index
    group: int                    # state spec group (-1: an attention layer)
    slot: int                     # index within the group (attention: within spec.kv)
    mixer: torch.nn.Module
    states: tuple[torch.Tensor, ...]   # page views [num_pages, channel, *inner], canonical order;
    #                                    attention: K and V views [blocks, heads, block, P]
    norm: torch.Tensor            # operator_norm (LFM2) / norm (Mamba2) / input_layernorm
    ffn_norm: torch.Tensor | None = None
    w1: torch.Tensor | None = None     # LFM2 [F/t, H]; Granite input_linear [2*S/t, H]
    w3: torch.Tensor | None = None     # LFM2 [F/t, H]
    w2: torch.Tensor | None = None     # LFM2 [H, F/t]; Granite output_linear [H, S/t]

    @property
    def attention(self) -> bool:
        return self.group < 0


def check_tp_size(config: ModelConfig, tp_size: int) -> None:
    """ConfigError unless ``tp_size`` splits the model's weights (the state's split is checked
    by the state spec's geometry)."""
    if config.model_type == "lfm2" and config.ff_dim % tp_size:
        raise ConfigError(f"lfm2: MLP width {config.ff_dim} (from intermediate_size="
                          f"{config.intermediate_size}) is not divisible by "
                          f"tp_size={tp_size}")
    if isinstance(config, GraniteHybridModelConfig) and config.shared_intermediate_size % tp_size:
        raise ConfigError(f"granitemoehybrid: shared_intermediate_size="
                          f"{config.shared_intermediate_size} is not divisible by "
                          f"tp_size={tp_size}")
    if config.attention_layers and config.num_attention_heads % tp_size:
        raise ConfigError(f"{config.model_type}: num_attention_heads="
                          f"{config.num_attention_heads} is not divisible by tp_size={tp_size}")


def _host_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device``; to a GPU through pinned memory and without blocking the host (a
    copy from pageable memory would wait for the device)."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def _to_device(device: torch.device, *parts: list[int]) -> list[torch.Tensor]:
    """Integer lists as int64 tensors on ``device`` through ONE host-to-device copy."""
    flat = _host_to_device(torch.tensor([x for part in parts for x in part], dtype=torch.int64), device)
    return list(flat.split([len(part) for part in parts]))


class _DeviceBlockTables:
    """Block tables on the device, one row per page, updated in place.

    ``rows(pages, tables)`` makes row ``pages[b]`` hold ``tables[b]`` (padded with -1) and
    returns those rows ``[B, max(len(t))]``. A host mirror of every row finds what changed: a
    decode step usually changes nothing (a request gains a block every ``block_size`` tokens),
    and whatever changed in the whole batch goes to the device as ONE ``[n, 3]`` tensor of
    (row, column, block) scattered in place. The width grows by doubling (a device copy).
    """

    def __init__(self, num_rows: int, device: torch.device) -> None:
        self.device = device
        self.table = torch.full((num_rows, 0), -1, dtype=torch.int64, device=device)
        self.mirror: list[list[int]] = [[] for _ in range(num_rows)]
        #: table entries sent to the device so far
        self.entries_sent = 0

    def rows(self, pages: list[int], page_ids: torch.Tensor, tables: list[list[int]]) -> torch.Tensor:
        width = max((len(t) for t in tables), default=0)
        if width > self.table.shape[1]:
            grown = torch.full((self.table.shape[0], max(width, 2 * self.table.shape[1])), -1,
                               dtype=torch.int64, device=self.device)
            grown[:, :self.table.shape[1]] = self.table
            self.table = grown
        changes: list[int] = []
        for page, table in zip(pages, tables):
            old = self.mirror[page]
            if old == table:
                continue
            for i, block in enumerate(table):
                if i >= len(old) or old[i] != block:
                    changes += (page, i, block)
            for i in range(len(table), len(old)):
                changes += (page, i, -1)
            self.mirror[page] = list(table)
        if changes:
            self.entries_sent += len(changes) // 3
            upd = _host_to_device(torch.tensor(changes, dtype=torch.int64), self.device).view(-1, 3)
            self.table[upd[:, 0], upd[:, 1]] = upd[:, 2]
        return self.table.index_select(0, page_ids)[:, :width]


class ModelRunner:
    """One TP rank of a model served from an HF checkpoint, state in ``cache`` pages.

    Args:
        model_dir: checkpoint directory (``config.json`` + ``model.safetensors`` or a sharded
            index) of ``Lfm2ForCausalLM`` (any ``layer_types``), ``Mamba2ForCausalLM`` or a dense
            ``GraniteMoeHybridForCausalLM``.
        tp_size, tp_rank: this rank's place in its TP group.
        cache: this rank's cache; its geometry must be built from
            ``StateSpec.from_pretrained(model_dir)`` (state dtypes may differ) at ``tp_size``,
            any layout. All recurrent state lives in its pages.
        kv: this rank's KV block pool (:class:`~statebridge.connector.rank.KVBlocks`, any KV
            layout and block size), required when the model has attention layers; its spec
            must be the model's (its dtype may differ).
        all_reduce: sums a tensor over the TP group (see :mod:`statebridge.models.distributed`);
            required when ``tp_size > 1``.
        dtype: weight and activation dtype (default: the checkpoint's ``dtype``).
        provider: kernel choice (``"auto"``: Triton on CUDA, torch references elsewhere).

    Raises ConfigError (missing weight, wrong cache or KV pool, TP size that does not divide
    the model), UnsupportedModelError (e.g. a MoE Granite), ShapeError (a weight of the wrong
    shape or dtype), each naming the value.
    """

    def __init__(self, model_dir: str | os.PathLike, tp_size: int, tp_rank: int,
                 cache: StateCache, *, kv: "KVBlocks | None" = None,
                 all_reduce: AllReduce | None = None,
                 dtype: torch.dtype | str | None = None, provider: str = "auto") -> None:
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
            raise ConfigError(f"tp_size must be a positive integer, got {tp_size!r}")
        if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) \
                or not 0 <= tp_rank < tp_size:
            raise ConfigError(f"tp_rank must be in [0, {tp_size}), got {tp_rank!r}")
        if tp_size > 1 and all_reduce is None:
            raise ConfigError(f"tp_size={tp_size} needs an all_reduce function")
        if not isinstance(cache, StateCache):
            raise ConfigError(f"cache must be a StateCache, got {type(cache).__name__}")
        if cache.geometry.tp_size != tp_size:
            raise ConfigError(f"cache geometry is for tp_size={cache.geometry.tp_size}, runner "
                              f"has tp_size={tp_size}")
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.cache = cache
        self.kv = kv
        self.device = cache.buffer.device
        self._all_reduce = all_reduce if tp_size > 1 else None
        self._provider = provider
        self._block_tables = _DeviceBlockTables(cache.num_pages, self.device) if kv is not None else None

        with Checkpoint(model_dir) as ckpt:
            config = ckpt.config
            self.config: ModelConfig = config
            expected = config.weight_shapes()  # refuses what the runtime cannot load
            self.spec = cache.geometry.spec
            model_spec = StateSpec.from_config(config)  # the same ModelConfig: same values
            if _spec_shape(model_spec) != _spec_shape(self.spec):
                raise ConfigError(
                    f"cache state spec {self.spec.fingerprint()} does not describe {model_dir!s} "
                    f"(expected {model_spec.fingerprint()}); build the cache's PageGeometry from "
                    f"StateSpec.from_pretrained(model_dir)")
            if dtype is None:
                self.dtype = DTYPES[config.dtype]
            elif isinstance(dtype, torch.dtype):
                self.dtype = dtype
            else:
                self.dtype = DTYPES[dtype_from_name(dtype)]
            check_tp_size(config, tp_size)
            self._check_kv(model_spec)
            ckpt.check(expected)
            stored = {ckpt.resolve(name) for name in expected}
            unused = [name for name in ckpt.names() if name not in stored]
            if unused:  # transformers ignores them too ("unexpected keys")
                log.warning("%s: %d checkpoint weights are not used, e.g. %s", model_dir,
                            len(unused), unused[:3])
            self._load(ckpt)
            #: bytes of each checkpoint weight this rank read (its shard of split weights)
            self.bytes_read: dict[str, int] = dict(ckpt.bytes_read)
        log.info("loaded %s (%d layers) rank %d/%d, %d weight bytes read, layout %s",
                 config.architecture, config.num_layers, tp_rank, tp_size,
                 sum(self.bytes_read.values()),
                 cache.geometry.layout.name)

    # -- loading ----------------------------------------------------------------------------------
    def _load(self, ckpt: Checkpoint) -> None:
        config, dev, dt = self.config, self.device, self.dtype
        t, r = self.tp_size, self.tp_rank

        def whole(name: str) -> torch.Tensor:
            return ckpt.get(name, dtype=dt, device=dev)

        def lazy(name: str):
            return ckpt.lazy(name, dtype=dt, device=dev)

        self.embed = whole(config.embedding_name)
        self.lm_head = self.embed if config.tie_word_embeddings else whole("lm_head.weight")
        final_norm = {"lfm2": "model.embedding_norm.weight", "mamba2": "backbone.norm_f.weight",
                      "granitemoehybrid": "model.norm.weight"}[config.model_type]
        self.final_norm = whole(final_norm)

        where = {layer_id: (g, j) for g, group in enumerate(self.spec.groups)
                 for j, layer_id in enumerate(group.layer_ids)}
        if self.spec.kv is not None:
            where.update({layer_id: (-1, j) for j, layer_id in enumerate(self.spec.kv.layer_ids)})
        shapes = config.weight_shapes()
        granite = config.model_type == "granitemoehybrid"
        self.layers: list[_Layer] = []
        for i in range(config.num_layers):
            if i not in where:
                raise ConfigError(f"layer {i} ({config.layer_types[i]!r}) has no state in the "
                                  f"cache spec")
            g, j = where[i]
            prefix = config.layer_prefix(i)
            weights = {name[len(prefix):]: lazy(name) for name in shapes
                       if name.startswith(prefix)}
            kind = config.layer_types[i]
            p = f"model.layers.{i}."
            if kind == "full_attention":
                mixer = tp.attention_from_hf(config, weights, t, r, provider=self._provider)
                states = self.kv.view(j)
            elif kind == "conv":
                mixer = tp.short_conv_from_hf(config, weights, t, r, provider=self._provider)
                states = (self.cache.view(g, "conv", j),)
            else:
                mixer = tp.mamba2_from_hf(config, weights, t, r, all_reduce=self._all_reduce,
                                          provider=self._provider)
                states = (self.cache.view(g, "conv", j), self.cache.view(g, "ssm", j))
            if config.model_type == "lfm2":
                mlp = {name: lazy(name) for name in shapes if name.startswith(p + "feed_forward.")}
                w1, w3, w2 = tp.lfm2_mlp_from_hf(config, mlp, t, r, prefix=p + "feed_forward.")
                layer = _Layer(
                    i, g, j, mixer, states, norm=whole(p + "operator_norm.weight"),
                    ffn_norm=whole(p + "ffn_norm.weight"), w1=w1, w3=w3, w2=w2)
            elif granite:
                mlp = {name: lazy(name) for name in shapes if name.startswith(p + "shared_mlp.")}
                w_in, w_out = tp.granite_mlp_from_hf(config, mlp, t, r, prefix=p + "shared_mlp.")
                layer = _Layer(
                    i, g, j, mixer, states, norm=whole(p + "input_layernorm.weight"),
                    ffn_norm=whole(p + "post_attention_layernorm.weight"), w1=w_in, w2=w_out)
            else:
                layer = _Layer(i, g, j, mixer, states,
                               norm=whole(f"backbone.layers.{i}.norm.weight"))
            self._check_state_views(layer)
            self.layers.append(layer)

    def _check_kv(self, model_spec: StateSpec) -> None:
        if model_spec.kv is None:
            return
        kv = self.kv
        if kv is None:
            raise ConfigError(f"{self.config.model_type} has attention layers "
                              f"{list(model_spec.kv.layer_ids)}: the runner needs the rank's KV "
                              f"block pool (kv=)")
        want = {k: v for k, v in model_spec.kv.to_dict().items() if k != "dtype"}
        got = {k: v for k, v in kv.geometry.kv.to_dict().items() if k != "dtype"}
        if want != got or kv.geometry.tp_size != self.tp_size:
            raise ConfigError(f"KV pool {got} at tp_size={kv.geometry.tp_size} does not describe "
                              f"the model's KV {want} at tp_size={self.tp_size}")

    def _check_state_views(self, layer: _Layer) -> None:
        mixer = layer.mixer
        if isinstance(mixer, AttentionMixer):
            want = [(mixer.kv_heads_local, self.kv.geometry.block_size, mixer.head_dim)] * 2
        elif isinstance(mixer, ShortConvMixer):
            want = [(mixer.dim_local, mixer.state_len)]
        else:
            want = [(mixer.conv_dim_local, mixer.state_len),
                    (mixer.heads_local, mixer.head_dim, mixer.d_state)]
        for view, shape in zip(layer.states, want):
            if tuple(view.shape[1:]) != shape:
                raise ConfigError(f"layer {layer.index}: cache state view {list(view.shape[1:])} "
                                  f"does not fit the local weights {list(shape)}")

    # -- public API -------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def layer_slots(self) -> dict[int, tuple[int, int]]:
        """HF layer index -> (state group, index within the group)."""
        return {layer.index: (layer.group, layer.slot) for layer in self.layers}

    @property
    def has_attention(self) -> bool:
        """Whether the model has attention layers (KV in the block pool)."""
        return self.spec.kv is not None

    @torch.no_grad()
    def prefill(self, prompts: Sequence[Sequence[int]], pages: Sequence[int], *,
                resume: bool | Sequence[bool] = False,
                blocks: Sequence[Sequence[int]] | None = None,
                starts: Sequence[int] | None = None) -> torch.Tensor:
        """Run prompts or chunks of prompts (a varlen batch) and write each one's final state
        into its page, and, with attention layers, the K and V of every token into its blocks.

        Args:
            prompts: B token sequences, any lengths, EMPTY allowed.
            pages: B distinct page ids of this rank's cache.
            resume: continue from the state already in the page (chunked prefill) instead of the
                zero state; one bool for all or one per prompt. With attention layers a
                resumed sequence names where it continues in ``starts``.
            blocks: B block tables of this rank's KV pool (logical block i of sequence b is
                ``blocks[b][i]``), each covering its sequence up to the end of ``prompts[b]``;
                required with attention layers.
            starts: B positions: tokens of each sequence already run (0: it starts here).
                Given, it decides ``resume`` (``starts[b] > 0``; a ``resume`` passed with it
                must agree). Positions ``0..starts[b]-1`` must already hold the sequence's K and
                V (the earlier chunks, run with the same blocks). A sequence run in chunks
                ends in the same state and K/V as run whole: the chunk boundaries change only
                the order of floating-point sums.

        Returns:
            ``[B, vocab]`` fp32 logits of each prompt's last token. An empty prompt has no last
            token: its row is all zeros (a placeholder, never NaN) and its page is reset to the
            zero state (or left as is with ``resume``). Under the N-1 protocol a 1-token prompt
            ``p`` prefills ``p[:-1] == []`` and its first logits come from ``decode(p[-1])``.
        """
        token_lists = [self._tokens(p, f"prompt {b}") for b, p in enumerate(prompts)]
        page_list = self._pages(pages, len(token_lists))
        B = len(token_lists)
        start_list = None
        if starts is not None:
            start_list = [int(x) for x in starts]
            if len(start_list) != B or min(start_list, default=0) < 0:
                raise ShapeError(f"starts {start_list} must be {B} integers >= 0")
            derived = [x > 0 for x in start_list]
            if not isinstance(resume, bool) or resume:
                given = [bool(resume)] * B if isinstance(resume, bool) else \
                    [bool(x) for x in resume]
                if given != derived:
                    raise ShapeError(f"resume {given} disagrees with starts {start_list}")
            resume = derived
        if isinstance(resume, bool):
            resume_list = [resume] * B
        else:
            resume_list = [bool(x) for x in resume]
            if len(resume_list) != B:
                raise ShapeError(f"resume has {len(resume_list)} entries for {B} prompts")
        ends = [len(t) + (start_list[b] if start_list else 0) for b, t in enumerate(token_lists)]
        tables = self._tables(blocks, ends)
        if self.has_attention and any(resume_list) and start_list is None:
            raise ConfigError(f"{self.config.model_type} has attention layers: a resumed "
                              f"prefill names the position it continues at (starts=)")
        logits = torch.zeros(B, self.vocab_size, dtype=torch.float32, device=self.device)
        rows = [b for b in range(B) if token_lists[b]]
        for b in range(B):
            if not token_lists[b] and not resume_list[b]:
                self.cache.page_bytes(page_list[b]).zero_()
        if not rows:
            return logits
        lengths = [len(token_lists[b]) for b in rows]
        qsl_list = [0]
        for n in lengths:
            qsl_list.append(qsl_list[-1] + n)
        row_pages = [page_list[b] for b in rows]
        chunked = start_list is not None and any(start_list[b] for b in rows)
        ids, qsl, slots, resumed, last, row_starts = _to_device(
            self.device, [tok for b in rows for tok in token_lists[b]], qsl_list, row_pages,
            [int(resume_list[b]) for b in rows], rows,
            [start_list[b] for b in rows] if chunked else [])
        has_init = resumed != 0
        row_tables = self._block_tables.rows(row_pages, slots, [tables[b] for b in rows]) \
            if tables is not None else None
        attention_starts = row_starts if chunked else None

        def mix(layer: _Layer, x: torch.Tensor) -> torch.Tensor:
            if layer.attention:
                return layer.mixer.prefill(x, *layer.states, qsl, row_tables, attention_starts)
            return layer.mixer.prefill(x, *layer.states, qsl, slots, has_init)

        hidden = self._layers(self._embed(ids), mix)
        logits[last] = self._logits(hidden[qsl[1:] - 1])
        return logits

    @torch.no_grad()
    def decode(self, tokens: Sequence[int], pages: Sequence[int], *,
               blocks: Sequence[Sequence[int]] | None = None,
               positions: Sequence[int] | None = None) -> torch.Tensor:
        """One token per request against, and updating, its page's state; with attention
        layers the token's K and V are written at ``positions[b]`` (the number of tokens before
        it) through block table ``blocks[b]`` (covering ``positions[b] + 1`` tokens), and it
        attends to positions ``0..positions[b]``.

        Returns ``[B, vocab]`` fp32 logits of the next token."""
        token_list = self._tokens(tokens, "tokens")
        page_list = self._pages(pages, len(token_list))
        if not token_list:
            return torch.zeros(0, self.vocab_size, dtype=torch.float32, device=self.device)
        table = pos = None
        if self.has_attention:
            if positions is None:
                raise ShapeError("decode of a model with attention layers needs positions")
            pos_list = [int(x) for x in positions]
            if len(pos_list) != len(token_list) or min(pos_list) < 0:
                raise ShapeError(f"positions {pos_list} must be {len(token_list)} integers >= 0")
            tables = self._tables(blocks, [n + 1 for n in pos_list])
            ids, slots, pos = _to_device(self.device, token_list, page_list, pos_list)
            table = self._block_tables.rows(page_list, slots, tables)
        else:
            ids, slots = _to_device(self.device, token_list, page_list)

        def mix(layer: _Layer, x: torch.Tensor) -> torch.Tensor:
            if layer.attention:
                return layer.mixer.decode(x, *layer.states, table, pos)
            return layer.mixer.decode(x, *layer.states, slots)

        return self._logits(self._layers(self._embed(ids), mix))

    def reset(self, pages: Sequence[int]) -> None:
        """Zero the state of ``pages`` (the state before any token)."""
        for page in self._pages(pages, None):
            self.cache.page_bytes(page).zero_()

    # -- forward ----------------------------------------------------------------------------------
    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return partial if self._all_reduce is None else self._all_reduce(partial)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = F.embedding(ids, self.embed)
        if self.config.model_type == "granitemoehybrid":
            hidden = hidden * self.config.embedding_multiplier
        return hidden

    def _layers(self, hidden: torch.Tensor,
                mix: Callable[[_Layer, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """hidden ``[T, H]`` through every decoder layer (HF's residual arithmetic)."""
        config = self.config
        eps = config.norm_eps
        kind = config.model_type
        for layer in self.layers:
            if kind == "lfm2":
                hidden = self._reduce(mix(layer, _rms_norm(hidden, layer.norm, eps))) + hidden
                x = _rms_norm(hidden, layer.ffn_norm, eps)
                partial = F.linear(F.silu(F.linear(x, layer.w1)) * F.linear(x, layer.w3), layer.w2)
                hidden = hidden + self._reduce(partial)
            elif kind == "granitemoehybrid":
                scale = config.residual_multiplier
                out = self._reduce(mix(layer, _rms_norm(hidden, layer.norm, eps)))
                hidden = hidden + out * scale
                x = _rms_norm(hidden, layer.ffn_norm, eps)
                gate, up = F.linear(x, layer.w1).chunk(2, dim=-1)
                hidden = hidden + self._reduce(F.linear(F.silu(gate) * up, layer.w2)) * scale
            else:
                residual = hidden.float() if config.residual_in_fp32 else hidden
                x = _rms_norm(hidden.to(layer.norm.dtype), layer.norm, eps)
                hidden = residual + self._reduce(mix(layer, x))
        return hidden

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        h = _rms_norm(hidden, self.final_norm, self.config.norm_eps)
        logits = F.linear(h.to(self.lm_head.dtype), self.lm_head).float()
        if self.config.model_type == "granitemoehybrid":
            logits = logits / self.config.logits_scaling
        return logits

    # -- argument checks --------------------------------------------------------------------------
    def _tokens(self, tokens: Sequence[int], what: str) -> list[int]:
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.tolist()
        try:
            out = [int(t) for t in tokens]
        except (TypeError, ValueError):
            raise ShapeError(f"{what} must be a sequence of token ids, got {tokens!r}") from None
        bad = [t for t in out if not 0 <= t < self.vocab_size]
        if bad:
            raise ShapeError(f"{what}: token id {bad[0]} outside the vocabulary "
                             f"[0, {self.vocab_size})")
        return out

    def _tables(self, blocks: Sequence[Sequence[int]] | None,
                tokens: Sequence[int]) -> list[list[int]] | None:
        """Block tables checked against the KV pool (None for a model without attention)."""
        if not self.has_attention:
            return None
        if blocks is None:
            raise ShapeError(f"{self.config.model_type} has attention layers: pass a KV block "
                             f"table per request (blocks=)")
        tables = [[int(x) for x in t] for t in blocks]
        if len(tables) != len(tokens):
            raise ShapeError(f"{len(tables)} block tables for {len(tokens)} requests")
        geo = self.kv.geometry
        for b, (table, n) in enumerate(zip(tables, tokens)):
            need = blocks_for(n, geo.block_size)
            if len(table) < need:
                raise ShapeError(f"request {b}: block table of {len(table)} blocks cannot hold "
                                 f"{n} tokens ({need} blocks of {geo.block_size})")
            bad = [x for x in table[:need] if not 0 <= x < geo.num_blocks]
            if bad:
                raise ShapeError(f"request {b}: block {bad[0]} not in the pool's "
                                 f"[0, {geo.num_blocks})")
            if len(set(table[:need])) != need:
                raise ShapeError(f"request {b}: block table {table[:need]} repeats a block")
        return tables

    def _pages(self, pages: Sequence[int], count: int | None) -> list[int]:
        page_list = list(pages)
        if count is not None and len(page_list) != count:
            raise ShapeError(f"{len(page_list)} pages for {count} requests")
        for page in page_list:
            self.cache.pool.check(page)
        if len(set(page_list)) != len(page_list):
            dup = next(p for p in page_list if page_list.count(p) > 1)
            raise CacheError(f"page {dup} appears twice in one batch: {page_list}")
        return page_list
