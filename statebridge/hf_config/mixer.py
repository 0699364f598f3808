"""The Mamba2 mixer's geometry, one shape whichever family's config.json it was read from.

Mamba2 (``Mamba2Config``) and dense GraniteMoeHybrid (the ``mamba_*`` fields of
``GraniteMoeHybridConfig``) run the same mixer (``Mamba2Mixer`` and
``GraniteMoeHybridMambaLayer``: the same weights and math) under two spellings. A
:class:`MixerKeys` says where one family keeps each value; :meth:`MixerKeys.read` reads them into
a :class:`Mamba2Geometry` and :meth:`MixerKeys.check` refuses a bad one naming that family's keys.
Sizes derived from the geometry (``intermediate_size``, ``conv_dim``, the weight shapes) are
computed here and nowhere else::

    in_proj rows   [ z (I) | x (I) | B (G*N) | C (G*N) | dt (H) ]      I = H * P = expand * hidden
    conv1d rows            [ x (I) | B (G*N) | C (G*N) ]               conv_dim, width K
    SSM state      H heads x (P, N)

(H ``num_heads``, P ``head_dim``, G ``n_groups``, N ``state_size``, K ``conv_kernel``.)
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal, Mapping

from statebridge.errors import ConfigError
from statebridge.hf_config.fields import _ABSENT, _bool, _int, _is_number, _lookup, _positive


@dataclass(frozen=True, slots=True, kw_only=True)
class Mamba2Geometry:
    """One Mamba2 mixer's sizes and biases under one set of names (``Mamba2Config``'s, with
    ``proj_bias``/``conv_bias`` for its ``use_bias``/``use_conv_bias``)."""

    hidden_size: int            # the model width the projections map from and to
    expand: int | float         # I / hidden_size, as the config writes it
    num_heads: int              # H
    head_dim: int               # P
    n_groups: int               # G
    state_size: int             # N
    conv_kernel: int            # K
    chunk_size: int             # the chunked scan's chunk length
    proj_bias: bool             # in_proj and out_proj biases
    conv_bias: bool             # conv1d bias

    @property
    def intermediate_size(self) -> int:
        """I = expand * hidden_size = num_heads * head_dim."""
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the depthwise conv: ``[x (I) | B (G*N) | C (G*N)]``."""
        return self.intermediate_size + 2 * self.n_groups * self.state_size

    def weight_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        """The weights of one mixer named ``prefix + name``, in module order (``Mamba2Mixer``
        and ``GraniteMoeHybridMambaLayer`` save the same ones)."""
        hidden, inner, conv_dim, heads = (self.hidden_size, self.intermediate_size,
                                          self.conv_dim, self.num_heads)
        rows = inner + conv_dim + heads
        out: dict[str, tuple[int, ...]] = {prefix + "in_proj.weight": (rows, hidden)}
        if self.proj_bias:
            out[prefix + "in_proj.bias"] = (rows,)
        out[prefix + "conv1d.weight"] = (conv_dim, 1, self.conv_kernel)
        if self.conv_bias:
            out[prefix + "conv1d.bias"] = (conv_dim,)
        out.update({prefix + "dt_bias": (heads,), prefix + "A_log": (heads,),
                    prefix + "D": (heads,), prefix + "norm.weight": (inner,),
                    prefix + "out_proj.weight": (hidden, inner)})
        if self.proj_bias:
            out[prefix + "out_proj.bias"] = (hidden,)
        return out


#: The geometry's fields that are positive numbers (the rest: hidden_size, read by the family,
#: and the two biases).
_POSITIVE = ("expand", "num_heads", "head_dim", "n_groups", "state_size", "conv_kernel",
             "chunk_size")


@dataclass(frozen=True, slots=True, kw_only=True)
class MixerKeys:
    """Where one family's ``config.json`` keeps each :class:`Mamba2Geometry` field but
    ``hidden_size``: the key, then older spellings read when it is absent. The first key is
    also the family config's attribute and the key its errors name. ``derived`` is
    ``"num_heads"`` or ``"head_dim"``: the size that, when absent, is ``expand * hidden_size``
    divided by the other one (which has a default), as the family's transformers config
    computes it."""

    family: str
    derived: Literal["num_heads", "head_dim"]
    expand: tuple[str, ...]
    num_heads: tuple[str, ...]
    head_dim: tuple[str, ...]
    n_groups: tuple[str, ...]
    state_size: tuple[str, ...]
    conv_kernel: tuple[str, ...]
    chunk_size: tuple[str, ...]
    proj_bias: tuple[str, ...]
    conv_bias: tuple[str, ...]

    def name(self, field: str) -> str:
        """The family's key (and attribute) for geometry field ``field``."""
        return getattr(self, field)[0]

    def read(self, config: Mapping[str, Any], defaults: Mapping[str, Any], *,
             hidden_size: int) -> Mamba2Geometry:
        """The geometry from a ``config.json`` dict; ``defaults`` are the family's, by key."""
        def number(field: str) -> int:
            return _int(config, *getattr(self, field), default=defaults[self.name(field)])

        def flag(field: str) -> bool:
            return _bool(config, *getattr(self, field), default=defaults[self.name(field)])

        expand = _positive(config, *self.expand, default=defaults[self.name("expand")])
        inner = expand * hidden_size
        if inner != int(inner):
            raise ConfigError(f"{self.family}: {self.name('expand')} * hidden_size = {expand} "
                              f"* {hidden_size} is not an integer")
        derived = self.derived
        given = "head_dim" if derived == "num_heads" else "num_heads"
        sizes = {given: number(given)}
        if _lookup(config, getattr(self, derived))[1] is _ABSENT:
            if int(inner) % sizes[given]:
                raise ConfigError(f"{self.family}: {self.name(given)}={sizes[given]} does not "
                                  f"divide {self.name('expand')} * hidden_size = {expand} * "
                                  f"{hidden_size}")
            sizes[derived] = int(inner) // sizes[given]
        else:
            sizes[derived] = _int(config, *getattr(self, derived), default=0)
        return Mamba2Geometry(
            hidden_size=hidden_size, expand=expand, **sizes,
            n_groups=number("n_groups"), state_size=number("state_size"),
            conv_kernel=number("conv_kernel"), chunk_size=number("chunk_size"),
            proj_bias=flag("proj_bias"), conv_bias=flag("conv_bias"))

    def attributes(self, geometry: Mamba2Geometry) -> dict[str, Any]:
        """The family config's attributes holding ``geometry`` (all but ``hidden_size``)."""
        return {self.name(f.name): getattr(geometry, f.name) for f in fields(Mamba2Geometry)
                if f.name != "hidden_size"}

    def geometry(self, config: Any) -> Mamba2Geometry:
        """The geometry a family config holds in its attributes (inverse of
        :meth:`attributes`)."""
        return Mamba2Geometry(hidden_size=config.hidden_size, **{
            f.name: getattr(config, self.name(f.name)) for f in fields(Mamba2Geometry)
            if f.name != "hidden_size"})

    def check(self, geometry: Mamba2Geometry, *, grouped: bool = True) -> None:
        """Refuse a geometry the mixer cannot run, naming this family's keys. ``grouped``:
        also require ``num_heads`` to be a multiple of ``n_groups`` (a family checks it only
        where it has Mamba2 layers)."""
        for field in _POSITIVE:
            value = getattr(geometry, field)
            if not _is_number(value) or value <= 0:
                raise ConfigError(f"{self.family}: {self.name(field)} must be > 0, got "
                                  f"{value!r}")
        inner = geometry.expand * geometry.hidden_size
        if inner != int(inner):
            raise ConfigError(f"{self.family}: {self.name('expand')} * hidden_size = "
                              f"{geometry.expand} * {geometry.hidden_size} is not an integer")
        if geometry.num_heads * geometry.head_dim != inner:
            raise ConfigError(f"{self.family}: {self.name('num_heads')} * "
                              f"{self.name('head_dim')} = {geometry.num_heads} * "
                              f"{geometry.head_dim} != {self.name('expand')} * hidden_size = "
                              f"{int(inner)}")
        if grouped and geometry.num_heads % geometry.n_groups:
            raise ConfigError(f"{self.family}: {self.name('num_heads')}={geometry.num_heads} is "
                              f"not a multiple of {self.name('n_groups')}={geometry.n_groups}")
