"""Tensor-parallel sharding of checkpoint weights: every slice a rank cuts from a weight is cut
here, and the kernels' mixers are built from the slices.

Which rows of a segment rank ``r`` of ``t`` holds is the state's rule
(:func:`statebridge.state.sharding.shard_segments`), so a rank's weights and its state pages
never disagree. A fused weight is a concatenation of segments along one axis, each sharded on
its own, and the local weight is the rank's pieces in segment order::

    ShortConv in_proj rows     [ B (D) | C (D) | x (D) ]                     all split
    ShortConv conv rows        [ D ]                 out_proj columns [ D ]
    Mamba2 in_proj rows        [ z (I) | x (I) | B (G*N) | C (G*N) | dt (H) ]
    Mamba2 conv rows           [ x (I) | B (G*N) | C (G*N) ]                 (the conv state's)
    Mamba2 dt_bias, A_log, D   [ H ]      norm [ I ]      out_proj columns [ I ]
    LFM2 MLP                   w1, w3 rows [ F ]          w2 columns [ F ]
    Granite shared MLP         input_linear rows [ gate (S) | up (S) ]   output_linear cols [ S ]
    attention q_proj rows      [ Hq * P ]   split by query heads (o_proj / out_proj columns too)
    attention k/v_proj rows    [ Hkv * P ]  split by KV heads, or ONE head per rank when
                                            tp > Hkv (rank r: head r * Hkv // tp, replicated)

Split segments give rank r rows ``[r*n/t, (r+1)*n/t)``; Mamba2's B and C are *grouped*: split
by groups when ``G % t == 0``, replicated on every rank when ``G == 1``. Row-parallel biases
(out_proj) stay on rank 0 only, so the ranks' partial outputs sum to the full output.

Weights may be :class:`~statebridge.models.checkpoint.LazyTensor` handles: :func:`shard_weight`
only ``narrow``s them, so a rank reads exactly its rows of the checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import torch

from statebridge.errors import ConfigError, ShapeError
from statebridge.hf_config import GraniteHybridModelConfig, Lfm2ModelConfig, Mamba2ModelConfig
from statebridge.kernels.layers import AllReduce, AttentionMixer, Mamba2Mixer, ShortConvMixer
from statebridge.state.sharding import kv_heads, segment_is_replicated, shard_segments
from statebridge.state.spec import KVSpec, Segment, Sharding

__all__ = ["shard_weight", "short_conv_from_hf", "mamba2_from_hf", "lfm2_mlp_from_hf",
           "attention_from_hf", "granite_mlp_from_hf"]


def shard_weight(weight: Any, segments: Sequence[Segment], tp_size: int, tp_rank: int, *,
                 dim: int = 0, name: str = "weight") -> torch.Tensor:
    """Rank ``tp_rank``'s shard of ``weight`` along ``dim``, segment by segment (contiguous).

    Args:
        weight: a full weight (tensor or lazy handle) whose axis ``dim`` is the concatenation of
            ``segments``.
        segments: the segments of that axis, in order (global sizes).
        tp_size, tp_rank: this rank's place in its TP group.
        dim: the fused axis.
        name: the weight, for error messages.
    """
    shards = shard_segments(segments, tp_size, tp_rank, name=name)
    total = sum(s.size for s in segments)
    if weight.shape[dim] != total:
        raise ShapeError(f"{name}: axis {dim} of shape {list(weight.shape)} must equal the sum "
                         f"of segments {[(s.name, s.size) for s in segments]} = {total}")
    pieces = [weight.narrow(dim, s.seg_offset + s.global_start, s.size) for s in shards]
    return torch.cat(pieces, dim=dim).contiguous()


def _split(name: str, size: int) -> tuple[Segment, ...]:
    return (Segment(name, size, Sharding.SPLIT),)


def _get(weights: Mapping[str, Any], prefix: str, name: str, required: bool = True) -> Any:
    key = prefix + name
    if key in weights:
        return weights[key].detach()
    if required:
        raise ConfigError(f"state dict has no {key!r} (keys: {sorted(weights)[:8]}...)")
    return None


def _shard(weights: Mapping[str, Any], prefix: str, tp_size: int, tp_rank: int, name: str,
           segments: Sequence[Segment], *, required: bool = True,
           dim: int = 0) -> torch.Tensor | None:
    """This rank's shard of weight ``prefix + name`` (None when absent and not required)."""
    t = _get(weights, prefix, name, required)
    return None if t is None else shard_weight(t, segments, tp_size, tp_rank, dim=dim,
                                               name=prefix + name)


def _projections(weights: Mapping[str, Any], prefix: str, tp_size: int, tp_rank: int, *,
                 conv: str, in_rows: Sequence[Segment], conv_rows: Sequence[Segment],
                 out_cols: Sequence[Segment]) -> dict[str, torch.Tensor | None]:
    """What both mixers shard the same way: column-parallel ``in_proj``, the depthwise conv
    (``[C, 1, K]`` -> ``[C_l, K]``), row-parallel ``out_proj`` (its bias whole on rank 0 only)
    and the optional biases, as the mixers' keyword arguments."""
    shard = partial(_shard, weights, prefix, tp_size, tp_rank)
    out_bias = _get(weights, prefix, "out_proj.bias", required=False)
    return {
        "in_proj_weight": shard("in_proj.weight", in_rows),
        "in_proj_bias": shard("in_proj.bias", in_rows, required=False),
        "conv_weight": shard_weight(_get(weights, prefix, f"{conv}.weight")[:, 0, :], conv_rows,
                                    tp_size, tp_rank, name=f"{prefix}{conv}.weight"),
        "conv_bias": shard(f"{conv}.bias", conv_rows, required=False),
        "out_proj_weight": shard("out_proj.weight", out_cols, dim=1),
        "out_proj_bias": None if out_bias is None or tp_rank != 0 else out_bias.clone(),
    }


def _check_config(config: Any, cls: type) -> None:
    if not isinstance(config, cls):
        raise ConfigError(f"expected a {cls.__name__} (ModelConfig.from_dict of the "
                          f"checkpoint's config.json), got {type(config).__name__}")


def short_conv_from_hf(config: Lfm2ModelConfig, weights: Mapping[str, Any], tp_size: int = 1,
                       tp_rank: int = 0, *, prefix: str = "", provider: str = "auto",
                       cls: type = ShortConvMixer) -> ShortConvMixer:
    """Rank ``tp_rank``'s ShortConv mixer from the HF ``Lfm2ShortConv`` weights (``in_proj``,
    ``conv``, ``out_proj``, optional biases) named ``prefix + name`` in ``weights``.

    ``cls`` is the mixer class (e.g. ``kernels.registry.get("short_conv")``)."""
    _check_config(config, Lfm2ModelConfig)
    dim, width = config.hidden_size, config.conv_L_cache
    bcx = (Segment("B", dim, Sharding.SPLIT), Segment("C", dim, Sharding.SPLIT),
           Segment("x", dim, Sharding.SPLIT))
    channels = _split("D", dim)
    conv_w = _get(weights, prefix, "conv.weight")
    if tuple(conv_w.shape) != (dim, 1, width):
        raise ShapeError(f"conv.weight must be [{dim}, 1, {width}], got {list(conv_w.shape)}")
    return cls(**_projections(weights, prefix, tp_size, tp_rank, conv="conv", in_rows=bcx,
                              conv_rows=channels, out_cols=channels),
               provider=provider)


def mamba2_from_hf(config: "Mamba2ModelConfig | GraniteHybridModelConfig",
                   weights: Mapping[str, Any], tp_size: int = 1,
                   tp_rank: int = 0, *, all_reduce: AllReduce | None = None, prefix: str = "",
                   provider: str = "auto", cls: type = Mamba2Mixer) -> Mamba2Mixer:
    """Rank ``tp_rank``'s Mamba2 mixer from the HF ``Mamba2Mixer`` (or
    ``GraniteMoeHybridMambaLayer``: the same weights and math) weights named ``prefix + name``
    in ``weights``.

    ``all_reduce`` sums over the TP group; it is required when ``n_groups == 1 < tp_size`` (the
    gated norm's group then spans ranks). ``cls`` is the mixer class."""
    if not isinstance(config, GraniteHybridModelConfig):
        _check_config(config, Mamba2ModelConfig)
    dims = config.mamba
    if config.hidden_act not in ("silu", "swish"):
        raise ConfigError(f"Mamba2 hidden_act must be silu, got {config.hidden_act!r}")
    limit = config.time_step_limit
    if limit[0] > 0.0 or limit[1] != float("inf"):
        raise ConfigError(f"Mamba2 time_step_limit={limit} is not supported (only (0, inf))")
    inner, heads, groups = dims.intermediate_size, dims.num_heads, dims.n_groups
    b = Segment("B", groups * dims.state_size, Sharding.GROUPED, groups)
    c = Segment("C", groups * dims.state_size, Sharding.GROUPED, groups)
    # G == 1 < t: B and C whole on every rank; G % t == 0: split by groups; else ConfigError.
    replicated = segment_is_replicated(b, tp_size, tensor="Mamba2 in_proj")
    in_segments = (Segment("z", inner, Sharding.SPLIT), Segment("x", inner, Sharding.SPLIT), b,
                   c, Segment("dt", heads, Sharding.SPLIT))
    conv_segments = (Segment("x", inner, Sharding.SPLIT), b, c)
    head_split = _split("heads", heads)
    shard = partial(_shard, weights, prefix, tp_size, tp_rank)
    return cls(
        **_projections(weights, prefix, tp_size, tp_rank, conv="conv1d", in_rows=in_segments,
                       conv_rows=conv_segments, out_cols=_split("I", inner)),
        dt_bias=shard("dt_bias", head_split),
        A_log=shard("A_log", head_split),
        D=shard("D", head_split),
        norm_weight=shard("norm.weight", _split("I", inner)),
        head_dim=dims.head_dim,
        d_state=dims.state_size,
        n_groups_local=groups if replicated else groups // tp_size,
        norm_group_size=inner // groups,
        chunk_size=dims.chunk_size,
        norm_eps=config.norm_eps,
        all_reduce=all_reduce,
        provider=provider,
    )


def attention_from_hf(config: "Lfm2ModelConfig | GraniteHybridModelConfig",
                      weights: Mapping[str, Any], tp_size: int = 1, tp_rank: int = 0, *,
                      prefix: str = "", provider: str = "auto",
                      cls: type = AttentionMixer) -> AttentionMixer:
    """Rank ``tp_rank``'s GQA attention from the HF ``Lfm2Attention`` (``q/k/v_proj``,
    ``out_proj``, ``q_layernorm``, ``k_layernorm``; RoPE at ``rope_theta``; scale
    ``head_dim ** -0.5``) or ``GraniteMoeHybridAttention`` (``q/k/v/o_proj`` with optional
    biases; RoPE only for ``position_embedding_type == "rope"``; scale
    ``attention_multiplier``) weights named ``prefix + name``.

    Column-parallel by heads: rank r holds query heads ``[r*Hq/t, (r+1)*Hq/t)`` and the KV
    heads of :func:`statebridge.state.sharding.kv_heads` (split, or one replicated head when
    ``t > Hkv``), so its query heads' GQA group is among its KV heads; o_proj row-parallel over
    the same query heads (its bias on rank 0 only)."""
    if isinstance(config, GraniteHybridModelConfig):
        out_name, scale = "o_proj", config.attention_multiplier
        theta = config.rope_theta if config.rotary else None
    else:
        _check_config(config, Lfm2ModelConfig)
        out_name, scale, theta = "out_proj", config.head_dim ** -0.5, config.rope_theta
    P, Hq, Hkv = config.head_dim, config.num_attention_heads, config.num_key_value_heads
    if Hq % tp_size:
        raise ConfigError(f"{config.model_type}: num_attention_heads={Hq} is not divisible by "
                          f"tp_size={tp_size}")
    first, count = kv_heads(KVSpec((0,), Hkv, P, "float32"), tp_size, tp_rank)
    q_rows = (tp_rank * (Hq // tp_size) * P, Hq // tp_size * P, Hq * P)  # start, length, of
    kv_rows = (first * P, count * P, Hkv * P)

    def rows(name: str, span: tuple[int, int, int], *, required: bool = True, dim: int = 0):
        t = _get(weights, prefix, name, required)
        if t is None:
            return None
        start, length, want = span
        if t.shape[dim] != want:
            raise ShapeError(f"{prefix}{name}: axis {dim} of shape {list(t.shape)} must be {want}")
        return t.narrow(dim, start, length).contiguous()

    out_bias = _get(weights, prefix, f"{out_name}.bias", required=False)
    norms = {}
    if isinstance(config, Lfm2ModelConfig):
        norms = {"q_norm_weight": _get(weights, prefix, "q_layernorm.weight").contiguous(),
                 "k_norm_weight": _get(weights, prefix, "k_layernorm.weight").contiguous()}
    return cls(
        q_proj_weight=rows("q_proj.weight", q_rows),
        k_proj_weight=rows("k_proj.weight", kv_rows),
        v_proj_weight=rows("v_proj.weight", kv_rows),
        o_proj_weight=rows(f"{out_name}.weight", q_rows, dim=1),
        q_proj_bias=rows("q_proj.bias", q_rows, required=False),
        k_proj_bias=rows("k_proj.bias", kv_rows, required=False),
        v_proj_bias=rows("v_proj.bias", kv_rows, required=False),
        o_proj_bias=None if out_bias is None or tp_rank != 0 else out_bias.clone(),
        head_dim=P, scale=scale, rope_theta=theta, norm_eps=config.norm_eps,
        provider=provider, **norms)


def granite_mlp_from_hf(config: GraniteHybridModelConfig, weights: Mapping[str, Any],
                        tp_size: int, tp_rank: int, *,
                        prefix: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``tp_rank``'s ``(input_linear, output_linear)`` of Granite's dense ``shared_mlp``:
    input_linear rows ``[gate (S) | up (S)]`` each split -> ``[2*S/t, hidden]``, output_linear
    columns split -> ``[hidden, S/t]``."""
    _check_config(config, GraniteHybridModelConfig)
    S = config.shared_intermediate_size
    if config.hidden_act not in ("silu", "swish"):
        raise ConfigError(f"granitemoehybrid: hidden_act must be silu, got "
                          f"{config.hidden_act!r}")
    halves = (Segment("gate", S, Sharding.SPLIT), Segment("up", S, Sharding.SPLIT))
    return (_shard(weights, prefix, tp_size, tp_rank, "input_linear.weight", halves),
            _shard(weights, prefix, tp_size, tp_rank, "output_linear.weight", _split("S", S),
                   dim=1))


def lfm2_mlp_from_hf(config: Lfm2ModelConfig, weights: Mapping[str, Any], tp_size: int,
                     tp_rank: int, *, prefix: str = "") -> tuple[torch.Tensor, ...]:
    """Rank ``tp_rank``'s ``(w1, w3, w2)`` of the LFM2 SwiGLU MLP (``prefix + "w1.weight"``...):
    w1 and w3 column-parallel ``[F/t, hidden]``, w2 row-parallel ``[hidden, F/t]``."""
    _check_config(config, Lfm2ModelConfig)
    ff = _split("F", config.ff_dim)
    return tuple(_shard(weights, prefix, tp_size, tp_rank, f"{w}.weight", ff,
                        dim=1 if w == "w2" else 0) for w in ("w1", "w3", "w2"))
