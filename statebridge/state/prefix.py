"""Names of reusable prompt prefixes: chained block hashes, checkpoint keys, and an index that
finds the longest usable prefix of a prompt.

A prefill group can reuse two things of an earlier prompt that shares a prefix with a new one:

* its **KV blocks** (attention layers): block ``i`` holds tokens ``[i*bs, (i+1)*bs)``; a full
  block is named by the chain hash ``h[i]`` of every token up to its end;
* its **recurrent-state checkpoints** (conv and SSM): a state has no partial form, so only a
  checkpoint taken after exactly ``n`` tokens serves a prefix of length ``n``. Checkpoints sit
  at the end of each prompt and at multiples of a stride (default 256 tokens, independent of
  the block size; 0: none) (:meth:`PrefixHasher.checkpoint_positions`); a prefill group adds
  the points where prompts branch (:mod:`statebridge.connector.prefix_cache`).

::

    root  = H("statebridge-prefix" | version | salt | block_size)
    h[0]  = H(root | tokens[0:bs])              tokens as little-endian int32
    h[i]  = H(h[i-1] | tokens[i*bs:(i+1)*bs])
    anchor(n) = h[n//bs - 1]   (root when n < bs)      the last full block before n
    key(n)    = H("ckpt" | anchor(n) | tokens[(n//bs)*bs:n] | n)

H is blake2b with 16-byte digests. The **salt** (:class:`PrefixSalt`) covers everything that
makes a state or KV block of the same tokens differ: the model (its identity and its
:class:`~statebridge.state.spec.StateSpec`, dtypes included), the page layout and page size,
the KV block layout and block size, the TP degree and rank count. So a key can only be found by a
prompt it is valid for, on a group whose bytes mean the same thing; a stale or foreign
checkpoint cannot match (cached objects are never mutated, see
:mod:`statebridge.connector.prefix_cache`).

**Usable prefix.** :meth:`PrefixIndex.longest` answers the longest ``n`` such that a checkpoint
``key(n)`` is indexed, with ``n <= len(tokens) - 1`` (at least the last token is always
prefilled: a hit never covers the whole prompt; it is capped, then rounded down to a usable
checkpoint). The KV side is covered by construction: an index entry stands for a unit that
holds every full block ``[0, n//bs)`` *and*, when ``n`` is not a block multiple, a private copy
of the partial tail block ``n//bs`` (its first ``n % bs`` token slots are valid). A hit copies
the checkpoint into the request's own page and the tail block into the request's first fresh
block (both are written from token ``n`` on); full blocks are shared read-only.

Python and numpy, and the chain in C (``_chainhash.c``, the same hashes as hashlib's; hashlib
where it is not built): no I/O, no threads.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import asdict, dataclass
from typing import Any, Callable, Generic, Iterator, Sequence, TypeVar

import numpy as np

from statebridge.errors import ConfigError

__all__ = ["PREFIX_HASH_VERSION", "DEFAULT_CHECKPOINT_TOKENS", "DIGEST_SIZE", "PrefixSalt",
           "Checkpoint", "PrefixHasher", "HashedPrompt", "PrefixIndex", "Match"]

#: Bumped whenever the hash recipe changes, so old announcements can never match.
PREFIX_HASH_VERSION = 1
#: Default checkpoint stride (``--prefix-checkpoint-tokens``; 0: checkpoints at prompt ends
#: and branch points only).
DEFAULT_CHECKPOINT_TOKENS = 256
#: Bytes of every hash and key.
DIGEST_SIZE = 16

_INT32_MAX = 2**31 - 1
E = TypeVar("E")


def _h(*parts: bytes) -> bytes:
    return hashlib.blake2b(b"".join(parts), digest_size=DIGEST_SIZE).digest()


def _chain_hashes(root: bytes, raw: bytes, block_bytes: int) -> list[bytes]:
    """``h[i] = H(h[i-1] | raw[i*block_bytes:(i+1)*block_bytes])`` for every full block of
    ``raw``, ``h[-1] = root``: the chain in Python. The C extension's ``chain``
    (``_chainhash.c``) computes the same list in one call; this is its fallback and its
    reference in the tests."""
    hashes, h = [], root
    for at in range(0, len(raw) // block_bytes * block_bytes, block_bytes):
        h = _h(h, raw[at:at + block_bytes])
        hashes.append(h)
    return hashes


try:
    from statebridge.state._chainhash import chain as _chain
except ImportError:  # pragma: no cover -- built by `pip install`
    _chain = _chain_hashes


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefixSalt:
    """Everything besides the tokens that makes a cached state or KV block valid.

    Two groups share cached objects only if every field is equal. ``spec_json`` is
    :meth:`StateSpec.to_json` (layers, segments, dtypes, KV heads); ``model`` names the weights
    (a checkpoint digest or name: two checkpoints with one config differ here). ``kv_layout`` and
    ``kv_block_size`` are ``""`` and 0 for a model without attention layers.
    """

    model: str = ""
    spec_json: str
    page_layout: str
    page_size: int
    kv_layout: str = ""
    kv_block_size: int = 0
    tp_size: int
    num_ranks: int

    def __post_init__(self) -> None:
        for name in ("page_size", "tp_size", "num_ranks"):
            _positive(name, getattr(self, name))
        if isinstance(self.kv_block_size, bool) or not isinstance(self.kv_block_size, int) \
                or self.kv_block_size < 0:
            raise ConfigError(f"kv_block_size must be an integer >= 0, got "
                              f"{self.kv_block_size!r}")

    @classmethod
    def of(cls, spec: Any, pages: Any, blocks: Any = None, *, model: str = "",
           num_ranks: int | None = None) -> "PrefixSalt":
        """The salt of a group: ``spec`` a :class:`~statebridge.state.spec.StateSpec`,
        ``pages`` its :class:`~statebridge.state.layout.PageGeometry`, ``blocks`` its
        :class:`~statebridge.state.kv.BlockGeometry` (None without attention); ``num_ranks``
        defaults to the TP degree."""
        return cls(model=model, spec_json=spec.to_json(), page_layout=pages.layout.name,
                   page_size=pages.page_size,
                   kv_layout=blocks.layout.order if blocks is not None else "",
                   kv_block_size=blocks.block_size if blocks is not None else 0,
                   tp_size=pages.tp_size,
                   num_ranks=pages.tp_size if num_ranks is None else num_ranks)

    def digest(self) -> bytes:
        """16 bytes over every field (canonical JSON)."""
        text = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return _h(b"statebridge-prefix-salt", text.encode())


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A recurrent-state checkpoint's name: ``key`` (after the first ``tokens`` tokens of a
    prompt) and ``anchor`` (the chain hash of its last full block, or the root), which lets an
    index find it from a prompt's block hashes without hashing every length. What a prefill
    node announces to a router."""

    key: bytes
    tokens: int
    anchor: bytes


class PrefixHasher:
    """Hashes prompts for one group: ``salt`` (a :class:`PrefixSalt` or its digest),
    ``block_size`` (the KV block size; any size for a model without attention), ``stride`` (the
    checkpoint stride in tokens; 0: checkpoints at prompt ends only)."""

    def __init__(self, salt: PrefixSalt | bytes, block_size: int, *,
                 stride: int = DEFAULT_CHECKPOINT_TOKENS) -> None:
        self.block_size = _positive("block_size", block_size)
        if isinstance(stride, bool) or not isinstance(stride, int) or stride < 0:
            raise ConfigError(f"checkpoint stride must be an integer >= 0, got {stride!r}")
        self.stride = stride
        if isinstance(salt, PrefixSalt):
            if salt.kv_block_size and salt.kv_block_size != block_size:
                raise ConfigError(f"hash block size {block_size} differs from the KV block size "
                                  f"{salt.kv_block_size} of the salt")
            salt = salt.digest()
        if not isinstance(salt, bytes) or not salt:
            raise ConfigError(f"salt must be a PrefixSalt or non-empty bytes, got {salt!r}")
        self.salt = salt
        self.root = _h(b"statebridge-prefix", PREFIX_HASH_VERSION.to_bytes(4, "little"), salt,
                       block_size.to_bytes(8, "little"))

    def prompt(self, tokens: Sequence[int] | np.ndarray) -> "HashedPrompt":
        """``tokens`` with the chain hash of every full block (one pass)."""
        return HashedPrompt(self, tokens)

    def first_hash(self, raw: bytes) -> bytes | None:
        """``h[0]`` of the prompt whose token ids are ``raw`` (little-endian int32 bytes, as on
        the wire), None when it holds less than one full block: one block hashed."""
        bb = self.block_size * 4
        return _chain(self.root, raw[:bb], bb)[0] if len(raw) >= bb else None

    def checkpoint_key(self, tokens: Sequence[int] | np.ndarray, n: int) -> bytes:
        """The key of the state after the first ``n`` tokens of ``tokens``."""
        return self.prompt(tokens[:n]).key_at(n)

    def checkpoint_positions(self, length: int, start: int = 0) -> list[int]:
        """Where a prefill of tokens ``[start, length)`` keeps checkpoints: the multiples of the
        stride in ``(start, length)`` (none for stride 0) and ``length`` itself (if
        ``length > start``)."""
        if length <= start:
            return []
        if not self.stride:
            return [length]
        first = (start // self.stride + 1) * self.stride
        return list(range(first, length, self.stride)) + [length]


class HashedPrompt:
    """A prompt as int32 tokens with its chain of full-block hashes (``hashes[i]`` = ``h[i]``,
    covering tokens ``[0, (i+1)*bs)``)."""

    __slots__ = ("hasher", "tokens", "hashes", "_raw")

    def __init__(self, hasher: PrefixHasher, tokens: Sequence[int] | np.ndarray) -> None:
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ConfigError(f"a prompt is a 1-D token sequence, got shape {arr.shape}")
        # (the ufuncs' own reduce: the ndarray methods' wrappers cost more than 1,024 ids; an
        # int32 array, as from the wire, needs no upper bound)
        if len(arr) and (arr.dtype.kind not in "iu" or int(np.minimum.reduce(arr)) < 0
                         or arr.dtype != np.int32 and int(np.maximum.reduce(arr)) > _INT32_MAX):
            bad = arr[(arr < 0) | (arr > _INT32_MAX)] if arr.dtype.kind in "iu" else arr[:1]
            raise ConfigError(f"token ids must be integers in [0, 2**31), got {bad[0]!r}")
        self.hasher = hasher
        self.tokens = arr.astype("<i4", copy=False)
        raw = self.tokens.tobytes()
        self._raw = memoryview(raw)
        self.hashes: list[bytes] = _chain(hasher.root, raw, hasher.block_size * 4)

    def __len__(self) -> int:
        return len(self.tokens)

    def anchor(self, n: int) -> bytes:
        """The chain hash of the last full block before token ``n`` (the root if none)."""
        self._check(n)
        b = n // self.hasher.block_size
        return self.hashes[b - 1] if b else self.hasher.root

    def key_at(self, n: int) -> bytes:
        """The key of the checkpoint after the first ``n`` tokens (``1 <= n <= len``)."""
        return self._key(n, self.anchor(n))

    def checkpoint(self, n: int) -> Checkpoint:
        anchor = self.anchor(n)
        return Checkpoint(self._key(n, anchor), n, anchor)

    def _key(self, n: int, anchor: bytes) -> bytes:
        if n < 1:
            raise ConfigError("a checkpoint covers at least one token")
        bs = self.hasher.block_size
        tail = self._raw[(n // bs) * bs * 4:n * 4]
        return _h(b"ckpt", anchor, tail, n.to_bytes(8, "little"))

    def _check(self, n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= len(self.tokens):
            raise ConfigError(f"prefix length {n!r} not in [0, {len(self.tokens)}]")


@dataclass(frozen=True, slots=True)
class Match(Generic[E]):
    """A usable prefix: the first ``tokens`` tokens, their checkpoint ``key`` and the index
    entry (``tokens == 0``, ``key == b""`` and ``entry is None`` for no match)."""

    tokens: int
    key: bytes
    entry: E | None


_NO_MATCH: Match = Match(0, b"", None)


class PrefixIndex(Generic[E]):
    """Checkpoint key -> entry, bucketed by anchor, answering :meth:`longest`.

    An entry stands for a checkpoint with every KV block it needs (the caller's invariant:
    :mod:`statebridge.connector.prefix_cache` indexes a unit only while it holds them; a router
    indexes what prefill nodes announce).
    """

    def __init__(self) -> None:
        self._entries: dict[bytes, tuple[Checkpoint, E]] = {}
        # anchor -> {tokens: how many keys} (prompts that share blocks may differ in the tail)
        self._anchors: dict[bytes, dict[int, int]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[Checkpoint]:
        return (c for c, _ in self._entries.values())

    def get(self, key: bytes) -> E | None:
        item = self._entries.get(key)
        return None if item is None else item[1]

    def add(self, checkpoint: Checkpoint, entry: E) -> None:
        """Index ``entry`` under ``checkpoint`` (ConfigError if its key is indexed already)."""
        if checkpoint.key in self._entries:
            raise ConfigError(f"checkpoint {checkpoint.key.hex()} ({checkpoint.tokens} tokens) "
                              f"is indexed already")
        self._entries[checkpoint.key] = (checkpoint, entry)
        bucket = self._anchors.setdefault(checkpoint.anchor, {})
        bucket[checkpoint.tokens] = bucket.get(checkpoint.tokens, 0) + 1

    def remove(self, key: bytes) -> E:
        """Drop ``key`` and return its entry (KeyError if absent)."""
        checkpoint, entry = self._entries.pop(key)
        bucket = self._anchors[checkpoint.anchor]
        bucket[checkpoint.tokens] -= 1
        if not bucket[checkpoint.tokens]:
            del bucket[checkpoint.tokens]
        if not bucket:
            del self._anchors[checkpoint.anchor]
        return entry

    def clear(self) -> None:
        self._entries.clear()
        self._anchors.clear()

    def longest(self, prompt: HashedPrompt, *, cap: int | None = None,
                accept: Callable[[E], bool] | None = None) -> Match[E]:
        """The longest indexed prefix of ``prompt`` of at most ``cap`` tokens (default
        ``len(prompt) - 1``: the last token is always prefilled) whose entry ``accept`` takes
        (default: any): the first of :meth:`matches` it takes."""
        for match in self.matches(prompt, cap=cap):
            if accept is None or accept(match.entry):
                return match
        return _NO_MATCH

    def matches(self, prompt: HashedPrompt, *, cap: int | None = None) -> Iterator[Match[E]]:
        """Every indexed prefix of ``prompt`` of at most ``cap`` tokens (default
        ``len(prompt) - 1``), longest first. One set intersection over the prompt's block
        hashes, then one key hash per indexed length the walk meets (a caller that stops
        early hashes no more)."""
        limit = len(prompt) - 1 if cap is None else min(cap, len(prompt))
        if limit < 1 or not self._entries:
            return
        bs = prompt.hasher.block_size
        anchors = self._anchors
        hashes = prompt.hashes[:limit // bs]
        # the blocks b whose anchor (h[b-1], or the root for 0) holds checkpoints, at C
        # speed (a miss ends here)
        found = anchors.keys() & hashes
        blocks = list(itertools.compress(range(1, len(hashes) + 1),
                                         map(found.__contains__, hashes))) if found else []
        if prompt.hasher.root in anchors:
            blocks.insert(0, 0)
        for b in reversed(blocks):
            anchor = hashes[b - 1] if b else prompt.hasher.root
            bucket = anchors.get(anchor)
            if not bucket:
                continue
            for n in sorted(bucket, reverse=True):
                if n > limit or n // bs != b:
                    continue
                key = prompt.key_at(n)
                item = self._entries.get(key)
                if item is not None:
                    yield Match(n, key, item[1])
