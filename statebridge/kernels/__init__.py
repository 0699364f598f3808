"""Kernels on recurrent state held in strided page views and on paged attention KV, each with a
torch reference.

Every op ``op`` (Triton) has ``op_ref`` (plain torch) with the same signature; the mixers pick
one by ``provider``. Importing this package decorates the Triton kernels: set
``TRITON_INTERPRET=1`` before the import to run them on CPU.
"""

from statebridge.kernels import registry
from statebridge.kernels.attention import paged_attention_decode, paged_attention_decode_ref
from statebridge.kernels.causal_conv1d import (
    causal_conv1d_fn,
    causal_conv1d_fn_ref,
    causal_conv1d_update,
    causal_conv1d_update_ref,
)
from statebridge.kernels.layers import Mamba2Mixer, ShortConvMixer
from statebridge.kernels.pack import pack, pack_ref, unpack, unpack_ref
from statebridge.kernels.ssm import mamba_chunk_scan_ref, selective_state_update, selective_state_update_ref

__all__ = [
    "Mamba2Mixer",
    "ShortConvMixer",
    "causal_conv1d_fn",
    "causal_conv1d_fn_ref",
    "causal_conv1d_update",
    "causal_conv1d_update_ref",
    "mamba_chunk_scan_ref",
    "pack",
    "pack_ref",
    "paged_attention_decode",
    "paged_attention_decode_ref",
    "registry",
    "selective_state_update",
    "selective_state_update_ref",
    "unpack",
    "unpack_ref",
]
