"""The Hugging Face ``config.json`` of an LFM2, Mamba2 or GraniteMoeHybrid (Granite-4.0-H)
checkpoint, read once, the way transformers reads it.

:meth:`ModelConfig.from_dict` and :meth:`ModelConfig.load` are the only readers of
``config.json``. The state spec (:mod:`statebridge.state.spec`), the checkpoint loader and runner
(:mod:`statebridge.models`) and the weight sharding (:mod:`statebridge.models.tp`) all take the
:class:`ModelConfig` they return, so no two of them can read a value differently::

    config.json --ModelConfig.from_dict--> Lfm2ModelConfig | Mamba2ModelConfig
                                           | GraniteHybridModelConfig
                                             |-> StateSpec.from_config   (page sizes)
                                             |-> ModelRunner, Checkpoint (weight names, norms)
                                             '-> models.tp               (weight shards)

One file per family (``lfm2.py``, ``mamba2.py``, ``granite.py``) on top of ``base.py``
(:class:`ModelConfig`) and ``fields.py`` (one reader per field type). Mamba2 and Granite's
Mamba2 layers share ONE mixer geometry, :class:`Mamba2Geometry` (``mixer.py``): each family
only says where its ``config.json`` keeps each value, and ``config.mamba`` is the same object
for the same mixer whichever family wrote it.

Rules, in the order they apply:

- **Defaults** are those of transformers' ``Lfm2Config`` / ``Mamba2Config`` /
  ``GraniteMoeHybridConfig`` (transformers 5; see :data:`LFM2_DEFAULTS`, :data:`MAMBA2_DEFAULTS`,
  :data:`GRANITE_DEFAULTS`). ``tests/test_hf_config.py`` checks every one against transformers
  itself. A ``null`` value counts as absent (except
  ``block_ffn_dim_multiplier``, where ``null`` means "no multiplier", as in ``Lfm2MLP``).
- **Derived, not defaulted**, only where transformers would refuse the config instead, so no
  config that transformers accepts is read differently: an LFM2 or Granite
  ``num_hidden_layers`` absent beside ``layer_types`` is ``len(layer_types)`` (transformers' 32
  must equal it); an absent Mamba2 ``num_heads`` is ``expand * hidden_size / head_dim``
  (transformers' 128 must equal it). Derived as transformers derives them: Granite
  ``num_key_value_heads`` (``num_attention_heads``), ``mamba_d_head`` (absent or ``"auto"``:
  ``mamba_expand * hidden_size // mamba_n_heads``) and ``head_dim`` (``hidden_size //
  num_attention_heads`` unless the config carries one, which ``GraniteMoeHybridAttention``
  then uses).
- **Aliases**: LFM2 ``block_ff_dim`` and ``tie_embedding`` win over ``intermediate_size`` and
  ``tie_word_embeddings``, as ``Lfm2Config.__post_init__`` lets them; the original mamba_ssm
  names ``d_model``, ``n_layer``, ``d_state``, ``headdim``, ``ngroups``, ``d_conv`` are read when
  the transformers name is absent; Granite ``layers_block_type`` wins over ``layer_types``
  (``attribute_map``: transformers sets it last).
- **Layer types** are stored in the state spec's names. Granite's ``"linear_attention"`` and
  legacy ``"mamba"`` are ``"mamba2"``; ``"full_attention"`` and legacy ``"attention"`` are
  ``"full_attention"`` (transformers' ``remap_legacy_layer_types``).
- **dtype**: ``dtype`` first, then ``torch_dtype``, then ``float32``. transformers >= 4.56 writes
  ``dtype`` and reads ``torch_dtype`` only as the legacy fallback
  (``PreTrainedConfig.__init__``: ``self.dtype = self.dtype if self.dtype is not None else
  torch_dtype``); most published configs still carry ``torch_dtype`` alone. With neither, the
  weights are float32 (torch's default dtype).
- **Special floats** written as ``{"__float__": "Infinity"}`` (transformers 5) or a bare
  ``Infinity`` (older writers) are decoded.
- **Errors**: a value of the wrong type or out of range raises
  :class:`~statebridge.errors.ConfigError` naming the key and the value; a ``model_type``, layer
  type or feature that statebridge cannot describe (Granite MoE: ``num_local_experts > 0``)
  raises :class:`~statebridge.errors.UnsupportedModelError`. Keys the runtime does not read are
  ignored.

Nothing here imports transformers.
"""

from statebridge.hf_config.base import ARCHITECTURES, ModelConfig, _READERS
from statebridge.hf_config.fields import (DEFAULT_DTYPE, decode_special_floats,
                                          encode_special_floats, read_config_json)
from statebridge.hf_config.granite import (GRANITE_DEFAULTS, GRANITE_LAYER_TYPES,
                                           GraniteHybridModelConfig)
from statebridge.hf_config.lfm2 import LFM2_DEFAULTS, LFM2_LAYER_TYPES, Lfm2ModelConfig
from statebridge.hf_config.mamba2 import MAMBA2_DEFAULTS, Mamba2ModelConfig
from statebridge.hf_config.mixer import Mamba2Geometry

__all__ = ["ModelConfig", "Lfm2ModelConfig", "Mamba2ModelConfig", "GraniteHybridModelConfig",
           "Mamba2Geometry",
           "LFM2_DEFAULTS", "MAMBA2_DEFAULTS", "GRANITE_DEFAULTS", "ARCHITECTURES",
           "LFM2_LAYER_TYPES", "GRANITE_LAYER_TYPES", "DEFAULT_DTYPE",
           "read_config_json", "decode_special_floats", "encode_special_floats"]

_READERS.update({cls.model_type: cls._read for cls in (Lfm2ModelConfig, Mamba2ModelConfig,
                                                        GraniteHybridModelConfig)})
