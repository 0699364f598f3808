"""Kernels on recurrent state held in strided page views and on paged attention KV, each with a
torch reference.

Every op ``op`` (Triton) has ``op_ref`` (plain torch) with the same signature; the mixers pick
one by ``provider``. Importing this package decorates the Triton kernels: set
``TRITON_INTERPRET=1`` before the import to run them on CPU. Every variant of every kernel the
wrappers launch is declared once (:mod:`statebridge.kernels._launch`) and compiled for sm_80
and sm_90 by :mod:`statebridge.kernels.compile_check`, on any machine.
"""

from statebridge.kernels import registry
from statebridge.kernels.attention import (
    check_paged_kv,
    paged_attention_decode,
    paged_attention_decode_ref,
    varlen_attention_prefill,
    varlen_attention_prefill_ref,
)
from statebridge.kernels.causal_conv1d import (
    causal_conv1d_fn,
    causal_conv1d_fn_ref,
    causal_conv1d_update,
    causal_conv1d_update_ref,
)
from statebridge.kernels.layers import Mamba2Mixer, ShortConvMixer
from statebridge.kernels.pack import RunTemplate, pack, pack_ref, prepare_runs, unpack, unpack_ref
from statebridge.kernels.ssd import (
    mamba_chunk_scan_ref,
    mamba_chunk_scan_varlen,
    mamba_chunk_scan_varlen_ref,
)
from statebridge.kernels.ssm import selective_state_update, selective_state_update_ref

__all__ = [
    "Mamba2Mixer",
    "RunTemplate",
    "ShortConvMixer",
    "causal_conv1d_fn",
    "check_paged_kv",
    "causal_conv1d_fn_ref",
    "causal_conv1d_update",
    "causal_conv1d_update_ref",
    "mamba_chunk_scan_ref",
    "mamba_chunk_scan_varlen",
    "mamba_chunk_scan_varlen_ref",
    "pack",
    "pack_ref",
    "paged_attention_decode",
    "paged_attention_decode_ref",
    "prepare_runs",
    "registry",
    "selective_state_update",
    "selective_state_update_ref",
    "unpack",
    "unpack_ref",
    "varlen_attention_prefill",
    "varlen_attention_prefill_ref",
]
