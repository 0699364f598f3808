"""Hugging Face checkpoints on disk: read one TP rank's shard of them, and write small random ones.

Reading. A checkpoint directory holds ``config.json`` and either ``model.safetensors`` or a
sharded ``model.safetensors.index.json`` (``{"weight_map": {name: file}}``) with its files.
:class:`Checkpoint` opens the files with safetensors' ``safe_open`` (memory-mapped; only the
headers are parsed) and hands out :class:`LazyTensor` handles. A handle reads nothing until its
rows are asked for: :meth:`LazyTensor.narrow` reads exactly the rows of one TP shard through
``get_slice``, so a rank never materialises rows of another rank's shard. The weight sharding
(:func:`statebridge.models.tp.shard_weight`) narrows segment by segment, so handing it handles
instead of tensors makes it read only what the rank keeps::

    in_proj [ B | C | x ] rows on disk      rank 1 of 2 reads        local weight
    [B0 B1 | C0 C1 | x0 x1]           ->     B1, C1, x1 (3 reads)  -> [B1 | C1 | x1]

:attr:`Checkpoint.bytes_read` counts the bytes read per weight (tests check the shard reads);
:func:`observe_reads` lets a loader see every read as it happens (a rank's progress line).

Writing. :func:`make_checkpoint` writes a random LFM2 (conv-only or with attention layers),
Mamba2 or dense GraniteMoeHybrid (Granite-4.0-H) checkpoint in exactly the format
``save_pretrained`` of transformers 5 writes (and a small tokenizer beside it) (``config.json`` with every field, safetensors with
``{"format": "pt"}`` metadata, tied ``lm_head`` omitted), without importing transformers; weight
names and shapes come from :meth:`ModelConfig.weight_shapes`.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch

from statebridge.dtypes import DTYPES, dtype_from_name
from statebridge.errors import ConfigError, ShapeError
from statebridge.hf_config import ModelConfig, encode_special_floats

__all__ = ["ARCHS", "Checkpoint", "LazyTensor", "make_checkpoint", "observe_reads", "PRESETS",
           "SAFE_WEIGHTS_NAME", "SAFE_WEIGHTS_INDEX_NAME"]

_observer = threading.local()


@contextlib.contextmanager
def observe_reads(callback) -> Iterator[None]:
    """Within the block, every weight read by a :class:`Checkpoint` on this thread calls
    ``callback(nbytes)`` (the bytes just read)."""
    previous = getattr(_observer, "callback", None)
    _observer.callback = callback
    try:
        yield
    finally:
        _observer.callback = previous

#: Other names a checkpoint may use for a weight (mamba_ssm-style Mamba2 checkpoints name the
#: embedding ``backbone.embedding``; transformers renames it on load).
WEIGHT_ALIASES: dict[str, tuple[str, ...]] = {
    "backbone.embeddings.weight": ("backbone.embedding.weight",),
}

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"

_ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}


class LazyTensor:
    """A read-on-demand view of one checkpoint tensor (``[:, 0, :]``-style basic indexing and
    :meth:`narrow` are free; data is read by :meth:`narrow` and :meth:`materialize`).

    Quacks like the few ``torch.Tensor`` members the weight sharding (:mod:`.tp`) uses
    (``shape``, ``dtype``, ``detach``, indexing, ``narrow``, ``clone``); any other torch
    function or attribute materialises the view first (correct, just not shard-frugal).
    Values come back cast to ``dtype`` on ``device``.
    """

    def __init__(self, checkpoint: "Checkpoint", name: str, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None,
                 view: tuple[tuple[int, int, bool], ...] | None = None) -> None:
        self._checkpoint = checkpoint
        self._name = name
        self._disk_dtype = checkpoint.dtype(name)
        self._dtype = dtype or self._disk_dtype
        self._device = torch.device(device) if device is not None else torch.device("cpu")
        # Per dimension on disk: (start, stop, squeezed). Squeezed dims were indexed by an int.
        self._view = view if view is not None else tuple(
            (0, n, False) for n in checkpoint.shape(name))

    @property
    def name(self) -> str:
        return self._name

    @property
    def shape(self) -> torch.Size:
        return torch.Size(stop - start for start, stop, squeezed in self._view if not squeezed)

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return self.ndim

    def size(self, dim: int | None = None) -> torch.Size | int:
        return self.shape if dim is None else self.shape[dim]

    def detach(self) -> "LazyTensor":
        return self

    def _disk_dims(self) -> list[int]:
        return [i for i, (_, _, squeezed) in enumerate(self._view) if not squeezed]

    def __getitem__(self, key: Any) -> "LazyTensor":
        if not isinstance(key, tuple):
            key = (key,)
        dims = self._disk_dims()
        if len(key) > len(dims):
            raise ShapeError(f"{self._name}: index {key!r} has more entries than dims {len(dims)}")
        view = list(self._view)
        for k, d in zip(key, dims):
            start, stop, _ = view[d]
            n = stop - start
            if isinstance(k, slice):
                lo, hi, step = k.indices(n)
                if step != 1:
                    raise ShapeError(f"{self._name}: strided index {k!r} is not supported lazily")
                view[d] = (start + lo, start + max(lo, hi), False)
            elif isinstance(k, int) and not isinstance(k, bool):
                i = k + n if k < 0 else k
                if not 0 <= i < n:
                    raise ShapeError(f"{self._name}: index {k} out of range for size {n}")
                view[d] = (start + i, start + i + 1, True)
            else:
                raise ShapeError(f"{self._name}: unsupported lazy index {k!r}")
        return LazyTensor(self._checkpoint, self._name, dtype=self._dtype, device=self._device,
                          view=tuple(view))

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Read rows ``[start, start + length)`` of visible dim ``dim`` (only those rows)."""
        dims = self._disk_dims()
        d = dims[dim]
        lo, hi, _ = self._view[d]
        if start < 0 or length < 0 or lo + start + length > hi:
            raise ShapeError(f"{self._name}: narrow({dim}, {start}, {length}) outside size "
                             f"{hi - lo}")
        view = list(self._view)
        view[d] = (lo + start, lo + start + length, False)
        return self._read(tuple(view))

    def materialize(self) -> torch.Tensor:
        """The whole view as a tensor."""
        return self._read(self._view)

    def clone(self) -> torch.Tensor:
        return self.materialize()

    def contiguous(self) -> torch.Tensor:
        return self.materialize()

    def _read(self, view: tuple[tuple[int, int, bool], ...]) -> torch.Tensor:
        tensor = self._checkpoint._read(self._name, tuple(slice(a, b) for a, b, _ in view))
        squeeze = [i for i, (_, _, s) in enumerate(view) if s]
        for i in reversed(squeeze):
            tensor = tensor.squeeze(i)
        tensor = tensor.to(device=self._device, dtype=self._dtype).contiguous()
        if tensor.device.type == "cpu" and self._checkpoint.maps(self._name, tensor):
            # Still a view of the file mapping: copy it, so the weights are the process's own
            # memory and the mapping (with every page read for other shards) goes when the
            # checkpoint is closed.
            tensor = tensor.clone()
        return tensor

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        def real(x: Any) -> Any:
            if isinstance(x, LazyTensor):
                return x.materialize()
            if isinstance(x, (list, tuple)):
                return type(x)(real(v) for v in x)
            return x
        return func(*real(args), **{k: real(v) for k, v in (kwargs or {}).items()})

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.materialize(), name)

    def __repr__(self) -> str:
        return f"LazyTensor({self._name!r}, shape={list(self.shape)}, dtype={self._dtype})"


class Checkpoint:
    """A checkpoint directory opened for reading (``with Checkpoint(path) as ckpt: ...``).

    ``config`` is its :class:`~statebridge.hf_config.ModelConfig` (``config.json`` read by the
    one reader). Weight names are resolved through :data:`WEIGHT_ALIASES`.
    """

    def __init__(self, model_dir: str | os.PathLike) -> None:
        self.model_dir = Path(model_dir)
        if not self.model_dir.is_dir():
            raise ConfigError(f"checkpoint directory not found: {str(self.model_dir)!r}")
        self.config = ModelConfig.load(self.model_dir)
        self._handles: dict[str, Any] = {}
        self._mapped: dict[str, tuple[tuple[int, int], ...]] = {}   # file -> its mappings
        self._file_of: dict[str, str] = {}
        self.bytes_read: dict[str, int] = defaultdict(int)
        single = self.model_dir / SAFE_WEIGHTS_NAME
        index = self.model_dir / SAFE_WEIGHTS_INDEX_NAME
        if single.is_file():
            names = self._open(SAFE_WEIGHTS_NAME).keys()
            self._file_of = {name: SAFE_WEIGHTS_NAME for name in names}
        elif index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ConfigError(f"{str(index)!r} is not a safetensors index "
                                  f"({type(e).__name__}: {e})") from None
            if not isinstance(weight_map, dict):
                raise ConfigError(f"{str(index)!r}: weight_map is not an object")
            self._file_of = {str(k): str(v) for k, v in weight_map.items()}
        else:
            raise ConfigError(f"checkpoint {str(self.model_dir)!r} has neither "
                              f"{SAFE_WEIGHTS_NAME} nor {SAFE_WEIGHTS_INDEX_NAME}")
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._dtypes: dict[str, torch.dtype] = {}

    # -- files --------------------------------------------------------------------------------
    def _open(self, filename: str) -> Any:
        handle = self._handles.get(filename)
        if handle is None:
            from safetensors import SafetensorError, safe_open

            path = self.model_dir / filename
            if not path.is_file():
                raise ConfigError(f"checkpoint {str(self.model_dir)!r}: weight file {filename!r} "
                                  f"listed in the index does not exist")
            try:
                handle = safe_open(str(path), framework="pt", device="cpu")
            except SafetensorError as e:
                raise ConfigError(f"checkpoint file {str(path)!r} is not valid safetensors: "
                                  f"{e}") from None
            self._handles[filename] = handle
            self._mapped[filename] = _mappings_of(path)
        return handle

    def close(self) -> None:
        """Drop the file handles (idempotent)."""
        self._handles.clear()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def files(self) -> list[str]:
        """The weight files the checkpoint's weights live in."""
        return sorted(set(self._file_of.values()))

    def open_file(self, filename: str) -> None:
        """Open ``filename`` (ConfigError when it is missing or not safetensors)."""
        self._open(filename)

    # -- metadata ------------------------------------------------------------------------------
    def names(self) -> list[str]:
        return sorted(self._file_of)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def resolve(self, name: str) -> str | None:
        """The name under which ``name`` is stored (itself or an alias), or None."""
        for candidate in (name, *WEIGHT_ALIASES.get(name, ())):
            if candidate in self._file_of:
                return candidate
        return None

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.resolve(name) is not None

    def _slice(self, name: str) -> Any:
        stored = self.resolve(name)
        if stored is None:
            raise ConfigError(f"checkpoint {str(self.model_dir)!r} has no weight {name!r}")
        return self._open(self._file_of[stored]).get_slice(stored)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._shapes:
            self._shapes[name] = tuple(int(n) for n in self._slice(name).get_shape())
        return self._shapes[name]

    def dtype(self, name: str) -> torch.dtype:
        if name not in self._dtypes:
            code = self._slice(name).get_dtype()
            if code not in _ST_DTYPES:
                raise ShapeError(f"weight {name!r} has unsupported dtype {code!r}")
            self._dtypes[name] = _ST_DTYPES[code]
        return self._dtypes[name]

    def check(self, expected: Mapping[str, tuple[int, ...]]) -> None:
        """Raise unless every weight of ``expected`` is present with that shape and a floating
        dtype: ConfigError names a missing weight, ShapeError a wrong shape or dtype."""
        for name, shape in expected.items():
            if name not in self:
                raise ConfigError(f"checkpoint {str(self.model_dir)!r} has no weight {name!r} "
                                  f"(expected shape {list(shape)} for "
                                  f"{self.config.architecture})")
            actual = self.shape(name)
            if actual != tuple(shape):
                raise ShapeError(f"checkpoint weight {name!r} has shape {list(actual)}, expected "
                                 f"{list(shape)} from config.json")
            if not self.dtype(name).is_floating_point:
                raise ShapeError(f"checkpoint weight {name!r} has dtype {self.dtype(name)}, "
                                 f"expected a floating dtype")

    # -- data ----------------------------------------------------------------------------------
    def lazy(self, name: str, *, dtype: torch.dtype | None = None,
             device: torch.device | str | None = None) -> LazyTensor:
        """A :class:`LazyTensor` handle of ``name`` (reads nothing yet)."""
        self.shape(name)
        return LazyTensor(self, name, dtype=dtype, device=device)

    def get(self, name: str, *, dtype: torch.dtype | None = None,
            device: torch.device | str | None = None) -> torch.Tensor:
        """The whole tensor ``name``."""
        return self.lazy(name, dtype=dtype, device=device).materialize()

    def maps(self, name: str, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s memory lies in this checkpoint's mapping of the file of weight
        ``name`` (safetensors hands out whole tensors and row ranges as views of it)."""
        ptr = tensor.untyped_storage().data_ptr()
        return any(a <= ptr < b for a, b in self._mapped.get(self._file_of[self.resolve(name)],
                                                              ()))

    def _read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        tensor = self._slice(name)[index] if index else self._slice(name)[:]
        nbytes = tensor.numel() * tensor.element_size()
        self.bytes_read[name] += nbytes
        callback = getattr(_observer, "callback", None)
        if callback is not None:
            callback(nbytes)
        return tensor


def _mappings_of(path: Path) -> tuple[tuple[int, int], ...]:
    """Address ranges ``[start, end)`` where ``path`` is mapped into this process (Linux
    ``/proc/self/maps``; () elsewhere)."""
    target = os.path.realpath(path)
    out = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].rstrip("\n") == target:
                    start, _, end = parts[0].partition("-")
                    out.append((int(start, 16), int(end, 16)))
    except OSError:
        return ()
    return tuple(out)


# -- writing ---------------------------------------------------------------------------------------

#: ``arch`` of :func:`make_checkpoint` -> the ``model_type`` it writes. ``lfm2`` and ``mamba2``
#: are recurrent-only; ``lfm2-hybrid`` and ``granite-hybrid`` are preset families of hybrid
#: models (ShortConv or Mamba2 layers with sparse attention layers).
ARCHS: dict[str, str] = {"lfm2": "lfm2", "mamba2": "mamba2", "lfm2-hybrid": "lfm2",
                         "granite-hybrid": "granitemoehybrid"}


def _layers(n: int, attention: tuple[int, ...], other: str) -> list[str]:
    return ["full_attention" if i in attention else other for i in range(n)]


#: ``(arch, preset)`` -> config.json fields that differ from the base configs below. Dims are
#: divisible by 4 so TP 1, 2 and 4 all shard them (attention: query heads split; KV heads split
#: where TP divides them, replicated where they divide TP).
PRESETS: dict[tuple[str, str], dict[str, Any]] = {
    ("lfm2", "tiny"): {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 192,
                       "block_multiple_of": 32, "num_hidden_layers": 4,
                       "num_attention_heads": 4, "num_key_value_heads": 2},
    ("lfm2", "small"): {"vocab_size": 2048, "hidden_size": 256, "intermediate_size": 1024,
                        "block_multiple_of": 64, "num_hidden_layers": 8,
                        "num_attention_heads": 8, "num_key_value_heads": 4},
    ("mamba2", "tiny"): {"vocab_size": 256, "hidden_size": 64, "num_heads": 8, "head_dim": 16,
                         "state_size": 16, "n_groups": 1, "num_hidden_layers": 4,
                         "chunk_size": 16},
    ("mamba2", "small"): {"vocab_size": 2048, "hidden_size": 256, "num_heads": 16,
                          "head_dim": 32, "state_size": 64, "n_groups": 4,
                          "num_hidden_layers": 8, "chunk_size": 64},
    # LFM2-1.2B's pattern (16 layers, attention at 2,5,8,10,12,14: conv first, attention about
    # every 3rd layer) scaled down; GQA 8 q / 4 KV heads of 8 (tiny), 16 q / 4 KV of 16 (small,
    # the 1.2B's ratio 4): KV heads split at TP 1, 2 and 4.
    ("lfm2-hybrid", "tiny"): {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 192,
                              "block_multiple_of": 32, "num_hidden_layers": 6,
                              "layer_types": _layers(6, (2, 4), "conv"),
                              "num_attention_heads": 8, "num_key_value_heads": 4},
    ("lfm2-hybrid", "small"): {"vocab_size": 2048, "hidden_size": 256, "intermediate_size": 1024,
                               "block_multiple_of": 64, "num_hidden_layers": 16,
                               "layer_types": _layers(16, (2, 5, 8, 10, 12, 14), "conv"),
                               "num_attention_heads": 16, "num_key_value_heads": 4},
    # Granite-4.0-H's pattern (40 layers, attention at 5,15,25,35: mostly Mamba2, attention
    # sparse and never first) scaled down; 2 KV heads (replicated at TP 4), n_groups 1 (B/C
    # replicated at every TP > 1), no RoPE. Multipliers as Granite's muP ones, scaled to the
    # size: embeddings x4 (the 0.25-scale random embeddings come out unit-scale),
    # attention 1/head_dim, residual 0.5 for few layers, logits / 2.
    ("granite-hybrid", "tiny"): {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 8,
                                 "layer_types": _layers(8, (2, 6), "linear_attention"),
                                 "num_attention_heads": 4, "num_key_value_heads": 2,
                                 "shared_intermediate_size": 128, "intermediate_size": 128,
                                 "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16,
                                 "mamba_chunk_size": 16, "attention_multiplier": 1 / 16},
    ("granite-hybrid", "small"): {"vocab_size": 2048, "hidden_size": 256,
                                  "num_hidden_layers": 16,
                                  "layer_types": _layers(16, (4, 12), "linear_attention"),
                                  "num_attention_heads": 8, "num_key_value_heads": 2,
                                  "shared_intermediate_size": 512, "intermediate_size": 512,
                                  "mamba_n_heads": 16, "mamba_d_head": 32, "mamba_d_state": 64,
                                  "mamba_chunk_size": 64, "attention_multiplier": 1 / 32},
    # What vLLM's CPU build serves (its attention kernel refuses heads narrower than 32): the
    # tiny shapes with 32-wide attention heads (2 KV heads: split at TP 1 and 2, replicated at
    # 4 and 8), conv and SSM dims divisible by 8 so every TP in {1, 2, 4, 8} shards them.
    ("lfm2", "vllm"): {"vocab_size": 256, "hidden_size": 128, "intermediate_size": 256,
                       "block_multiple_of": 32, "num_hidden_layers": 4,
                       "num_attention_heads": 4, "num_key_value_heads": 2},
    ("mamba2", "vllm"): {"vocab_size": 256, "hidden_size": 64, "num_heads": 8, "head_dim": 16,
                         "state_size": 16, "n_groups": 1, "num_hidden_layers": 4,
                         "chunk_size": 16},
    ("lfm2-hybrid", "vllm"): {"vocab_size": 256, "hidden_size": 128, "intermediate_size": 256,
                              "block_multiple_of": 32, "num_hidden_layers": 6,
                              "layer_types": _layers(6, (2, 4), "conv"),
                              "num_attention_heads": 4, "num_key_value_heads": 2},
    ("granite-hybrid", "vllm"): {"vocab_size": 256, "hidden_size": 128, "num_hidden_layers": 8,
                                 "layer_types": _layers(8, (2, 6), "linear_attention"),
                                 "num_attention_heads": 4, "num_key_value_heads": 2,
                                 "shared_intermediate_size": 256, "intermediate_size": 256,
                                 "mamba_n_heads": 16, "mamba_d_head": 16, "mamba_d_state": 16,
                                 "mamba_chunk_size": 16, "attention_multiplier": 1 / 32},
}

_LFM2_BASE: dict[str, Any] = {
    "architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2",
    "block_auto_adjust_ff_dim": True, "block_ffn_dim_multiplier": 1.0, "block_multiple_of": 256,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "conv_L_cache": 3,
    "conv_bias": False, "full_attn_idxs": None, "initializer_range": 0.02,
    "max_position_embeddings": 128000, "norm_eps": 1e-05,
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
    "tie_word_embeddings": True, "use_cache": True,
}

_MAMBA2_BASE: dict[str, Any] = {
    "architectures": ["Mamba2ForCausalLM"], "model_type": "mamba2",
    "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 1, "conv_kernel": 4, "expand": 2,
    "hidden_act": "silu", "initializer_range": 0.1, "layer_norm_epsilon": 1e-05,
    "rescale_prenorm_residual": False, "residual_in_fp32": True, "tie_word_embeddings": False,
    "time_step_floor": 0.0001, "time_step_limit": [0.0, math.inf], "time_step_max": 0.1,
    "time_step_min": 0.001, "use_bias": False, "use_cache": True, "use_conv_bias": True,
}

#: A dense GraniteMoeHybrid (Granite-4.0-H) config as ``save_pretrained`` writes it (layer types
#: in transformers 5's names, ``"linear_attention"`` / ``"full_attention"``).
_GRANITE_BASE: dict[str, Any] = {
    "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
    "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "pad_token_id": 0, "hidden_act": "silu", "initializer_range": 0.02,
    "max_position_embeddings": 131072, "num_local_experts": 0, "num_experts_per_tok": 0,
    "output_router_logits": False, "router_aux_loss_coef": 0.01, "rms_norm_eps": 1e-05,
    "position_embedding_type": "nope",
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "embedding_multiplier": 4.0, "attention_multiplier": 1.0, "residual_multiplier": 0.5,
    "logits_scaling": 2.0, "mamba_n_groups": 1, "mamba_d_conv": 4, "mamba_expand": 2,
    "mamba_conv_bias": True, "mamba_proj_bias": False, "time_step_limit": [0.0, math.inf],
    "tie_word_embeddings": False, "use_cache": True,
}

_BASES = {"lfm2": _LFM2_BASE, "mamba2": _MAMBA2_BASE, "granitemoehybrid": _GRANITE_BASE}


def _preset_config(arch: str, preset: str, dtype: str,
                   overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    if arch not in ARCHS:
        raise ConfigError(f"unknown arch {arch!r}; expected one of {list(ARCHS)}")
    if (arch, preset) not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r} for arch {arch!r}; expected one of "
                          f"{sorted(p for a, p in PRESETS if a == arch)}")
    model_type = ARCHS[arch]
    config = copy.deepcopy(_BASES[model_type])
    config.update(copy.deepcopy(PRESETS[(arch, preset)]))
    config["dtype"] = dtype
    config.update(overrides or {})
    if model_type == "lfm2":
        if config.get("layer_types") is None:
            config["layer_types"] = ["conv"] * config["num_hidden_layers"]
        # Released LFM2 checkpoints carry both (vLLM's Lfm2Config reads them; transformers
        # ignores them): the ShortConv width and the block width, both the hidden size.
        config.setdefault("conv_dim", config["hidden_size"])
        config.setdefault("block_dim", config["hidden_size"])
    elif model_type == "mamba2":
        config["time_step_rank"] = config.get("time_step_rank") or math.ceil(
            config["hidden_size"] / 16)
    return config


def _random_weight(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """A well-conditioned random value for weight ``name`` (fp32): activations stay O(1) and the
    greedy token is rarely a near tie, so TP sum orders cannot flip it."""
    module = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
    if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if name.endswith(".bias"):
        return 0.1 * torch.randn(shape, generator=gen)
    if name.endswith("A_log"):
        return torch.log(torch.empty(shape).uniform_(1.0, 16.0, generator=gen))
    if name.endswith(".D"):
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if name.endswith("dt_bias"):
        u = torch.rand(shape, generator=gen)
        dt = torch.exp(u * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
        return dt + torch.log(-torch.expm1(-dt))  # inverse softplus
    if module in ("embed_tokens", "embeddings", "embedding"):
        # Small next to what the layers add, so that tied logits (embed . h) are not dominated
        # by the input token's own embedding (greedy would echo the last token forever).
        return 0.25 * torch.randn(shape, generator=gen)
    # Linear [out, in] and depthwise conv [C, 1, K]: unit gain over the fan-in.
    return torch.randn(shape, generator=gen) / math.sqrt(shape[-1])


def make_checkpoint(arch: str, out_dir: str | os.PathLike, preset: str = "tiny", seed: int = 0,
                    *, dtype: str | torch.dtype = "float32",
                    overrides: Mapping[str, Any] | None = None,
                    max_shard_bytes: int | None = None, overwrite: bool = True,
                    tokenizer: bool = True) -> Path:
    """Write a random ``arch`` checkpoint (see :data:`ARCHS`) of ``preset`` size.

    Args:
        arch: ``"lfm2"`` (conv layers only), ``"mamba2"``, ``"lfm2-hybrid"`` (LFM2 with
            attention layers in LFM2-1.2B's pattern) or ``"granite-hybrid"`` (dense
            GraniteMoeHybrid in Granite-4.0-H's pattern: Mamba2 with sparse attention).
        out_dir: directory to write ``config.json`` and the safetensors into (created).
        preset: ``"tiny"`` (hidden 64, 4 to 8 layers, vocab 256: a demo runs in seconds on 2
            CPU cores) or ``"small"`` (hidden 256, 8 to 16 layers, vocab 2048); see
            :data:`PRESETS`.
        seed: the weights are a pure function of (arch, preset, overrides, seed).
        dtype: weight dtype and the config's ``dtype``.
        overrides: config.json fields to change (e.g. ``{"n_groups": 4}``); shapes follow.
        max_shard_bytes: when set, split the weights into ``model-0000i-of-0000n.safetensors``
            files of at most this many bytes (a tensor is never split) plus
            ``model.safetensors.index.json``, as ``save_pretrained(max_shard_size=...)`` does.
        overwrite: when False, refuse a directory that already holds a config.json.
        tokenizer: also write a small byte-level BPE tokenizer trained on a bundled text, with
            a chat template (``tokenizer.json``, ``tokenizer_config.json``; see
            :mod:`statebridge.models.tokenizer`).

    Returns the checkpoint directory. It loads in transformers with
    ``AutoModelForCausalLM.from_pretrained(out_dir)``.
    """
    from safetensors.torch import save_file

    dtype_name = dtype_from_name(dtype)
    config = _preset_config(arch, preset, dtype_name, overrides)
    shapes = ModelConfig.from_dict(config).weight_shapes()  # validates (refuses Granite MoE)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if (out / "config.json").exists() and not overwrite:
        raise ConfigError(f"{str(out)!r} already holds a checkpoint (pass overwrite=True)")
    for stale in [SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, *(
            p.name for p in out.glob("model-*-of-*.safetensors"))]:
        (out / stale).unlink(missing_ok=True)

    gen = torch.Generator().manual_seed(int(seed))
    torch_dtype = DTYPES[dtype_name]
    tensors = {name: _random_weight(name, shape, gen).to(torch_dtype).contiguous()
               for name, shape in shapes.items()}

    text = json.dumps(encode_special_floats(config), indent=2, sort_keys=True) + "\n"
    (out / "config.json").write_text(text, encoding="utf-8")
    if tokenizer:
        from statebridge.models.tokenizer import write_tokenizer

        write_tokenizer(config, out)
    metadata = {"format": "pt"}
    if max_shard_bytes is None:
        save_file(tensors, str(out / SAFE_WEIGHTS_NAME), metadata=metadata)
        return out
    if max_shard_bytes <= 0:
        raise ConfigError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        filename = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / filename), metadata=metadata)
        weight_map.update({name: filename for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / SAFE_WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n",
                                               encoding="utf-8")
    return out
