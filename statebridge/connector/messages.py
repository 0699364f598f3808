"""Control-plane messages: the vocabulary, as frozen typed dataclasses.

They travel through the ONE msgpack codec, :mod:`statebridge.connector.codec` (envelope,
version check, field checks, row batches), whose names this module re-exports: ``m.encode``,
``m.decode``, ``m.message`` and the rest.

Handshake (decode group connects to a prefill group)::

    decode coordinator                           prefill server
      Hello(version, compat hash)  ------------>   checks version + compat_hash
                                   <------------   Hello | Reject
      GroupInfo(addresses, geometry) ---------->
                                   <------------   GroupInfo(addresses, geometry)

The compatibility hash (:func:`compat_hash`) covers the protocol version and the state spec
(model dims, segments, state_len, dtypes). Page layouts are NOT in it on purpose: the two sides
may use different layouts (the transfer plan stages those); they travel in ``GroupInfo``.

Per request (N-1 protocol, see DESIGN.md): ``TransferRequest`` decode -> prefill, then only
``TransferFailed`` / ``Abort`` (either way) when something fails; ``Heartbeat`` both ways. A
success needs no word between the nodes: the decode side learns it from its ranks, the
prefill side from its own (version 4 dropped ``TransferComplete``). For a spec with attention
KV (``spec.kv``) the request carries the decode block table and the prefill side takes one
contiguous range, so the decode ranks post the KV receives with the recurrent ones (version 4
dropped the ``TransferAccepted`` / ``RankKVRecv`` round trip of version 3).
Inside a group, the coordinator and its rank processes use the ``Rank*`` messages. A request
attempt is named on every process by its :class:`~statebridge.connector.ledger.RequestKey`:
the node on the other side of the transfer (``peer_node``), the request id, and the generation
the decode node gave the attempt.

Versions (``PROTOCOL_VERSION``, in the codec). Version 5: prompts travel as little-endian
int32 token bytes (:class:`Tokens`), and the per-request messages inside a group
(:attr:`Message.BATCH` types) that an event loop queues to one peer in one iteration leave as
one frame of value rows (:func:`encode_rows`, read with :func:`decode_frame`).

Version 7: same-host shared-map reads (:class:`GroupInfo` ``shared_map*``). Version 8: a
hybrid link that reads shared maps moves attention KV (and every zero-copy recurrent pair)
that way too. Version 9: a reader answers in the prefill rank's memory, not with a message.
The "ready" notice a prefill rank sends per pair, and the answer word, are described in ONE
place: :class:`~statebridge.connector.data.shared.NoticeSlot`.

Version 10: a coordinator tells its ranks to connect to a peer group by forwarding the peer's
checked :class:`GroupInfo` as it came (``RankConnect``, a hand-made copy of its fields with a
``peer_`` prefix, is gone): one handshake record between groups and inside them.

Version 11: ``RankDone`` carries what the protocol needs (outcome and bytes moved); what a
benchmark or a test measures or verifies travels in :class:`RankProbe`, which only an
instrumented rank sends (the one switch, documented there).

Version 12: :class:`GroupInfo` ``memory`` (what the group's pools are in: host or CUDA device
memory; two same-host device groups read through the prefill rank's exported pool), and
:class:`RankTransports` (the transports UCX chose for each peer rank, for the node's stats);
``RankDone`` says when a rank's events happened (compute, first post, landed), and the prefill side tells the decode side its part in one :class:`TransferTimes` row per
request (off the request's path: the decode side serves without it), so the transfer time
is measured from the first byte posted to the last byte landed; and transfer verification
(``ConnectorConfig.verify_transfers``): ``GroupInfo`` says
whether a group verifies (decode) or sends digests (prefill); a prefill rank reports the
digests of what it sends (:class:`RankDigest`), its server forwards their sums per decode rank
(:class:`TransferDigest`), a decode rank reports the digest of what landed in ``RankDone``.

Version 13: prefix caching (``connector/prefix_cache.py``). :class:`GroupInfo` says whether a
prefill group keeps a prefix cache and the salt, block size and stride its keys are made with;
:class:`TransferRequest` ``prefix_cache`` lets a decode node turn hits off per request;
:class:`RankPrefill` names the cached state and blocks a request starts from and the pages its
checkpoints go to; :class:`TransferTimes` ``cached_tokens``; :class:`PrefixAnnounce` tells the
decode side which checkpoints a prefill node holds (its routing); :class:`RankHello`
``chunked_prefill`` (a hit needs a model that prefills from a state).

Layers above the connector (the decode node's stepping and front door) declare their own
messages with :func:`message`; they travel through the same codec.
"""

from __future__ import annotations

from statebridge.connector.codec import (  # noqa: F401 -- the codec's names, re-exported
    MAX_BATCH_ROWS,
    MAX_MESSAGE_BYTES,
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    Message,
    Tokens,
    compat_hash,
    decode,
    decode_frame,
    encode,
    encode_rows,
    message,
    message_row,
    pack_tokens,
    token_count,
    unpack_tokens,
)

__all__ = [
    "PROTOCOL_VERSION", "MAX_MESSAGE_BYTES", "Message", "message", "encode", "decode",
    "compat_hash", "MESSAGE_TYPES", "message_row", "encode_rows", "decode_frame",
    "MAX_BATCH_ROWS", "Tokens", "pack_tokens", "unpack_tokens", "token_count",
    "Hello", "Reject", "GroupInfo", "TransferRequest", "TransferTimes", "TransferFailed",
    "Abort", "Heartbeat", "Error", "Goodbye", "TransferDigest",
    "RankHello", "RankPrefill", "RankRecv", "RankDone", "RankProbe", "PROBES", "RankCancel",
    "RankShutdown", "RankLocalPrefill", "RankFailed", "RankTransports", "RankDigest",
]


# -- between groups ----------------------------------------------------------------------------

@message
class Hello(Message):
    """Phase 1 of the handshake, both directions."""
    compat_hash: str
    node_id: str
    role: str                      # "prefill" | "decode"


@message
class Reject(Message):
    """The handshake was refused (incompatible peer, bad message, limits)."""
    code: str
    reason: str


@message
class GroupInfo(Message):
    """Phase 2: everything a peer needs to plan and connect (one entry per TP rank). Once
    checked, the coordinator forwards it as it came to its own ranks: their command to open
    UCX endpoints to that group and plan transfers with it."""
    node_id: str
    role: str
    tp_size: int
    layout: str
    page_size: int
    region_align: int
    num_pages: int
    spec_json: str
    rank_addresses: tuple[bytes, ...]
    #: The KV block pool of every rank (``num_blocks`` 0: no KV, the spec has none).
    kv_layout: str = "HB"
    block_size: int = 16
    num_blocks: int = 0
    #: :func:`statebridge.net.host_id` of the node's machine ("" unknown): a peer group on the
    #: same host moves state over shared memory, which the receiver reads by itself (a rank
    #: compares it with its own).
    host_id: str = ""
    #: Same-host shared-map reads (``connector/data/shared/``): this group takes part (a
    #: prefill group's rank buffers are memfds, a decode group reads them); a prefill group
    #: also lists each rank's pid and buffer descriptor. Protocol 7.
    shared_map: bool = False
    rank_pids: tuple[int, ...] = ()
    rank_shm_fds: tuple[int, ...] = ()
    #: A prefill group's ``ConnectorConfig.shared_map_min_bytes``: which pairs go that way.
    shared_map_min_bytes: int = 0
    #: What every rank's pages and KV pool are in: "host" or "cuda" (device memory; a prefill
    #: group's ranks then export their pool to same-host readers). Protocol 12.
    memory: str = "host"
    #: ``ConnectorConfig.verify_transfers``: a decode group verifies what lands (and refuses
    #: a prefill group that does not send digests); a prefill group sends digests to the
    #: decode groups that verify. Protocol 12.
    verify_transfers: bool = False
    #: A prefill group's prefix cache (protocol 13): on, and what its checkpoint keys are made
    #: of (:class:`~statebridge.state.prefix.PrefixHasher`: the salt's digest, the KV block
    #: size above, ``prefix_stride`` tokens between periodic checkpoints, 0: none), so a decode
    #: node can hash a prompt as that group does and route it where its prefix lives.
    prefix_cache: bool = False
    prefix_salt: bytes = b""
    prefix_stride: int = 0


@message
class TransferRequest(Message):
    """Decode -> prefill: compute ``prompt`` and send its state to the decode ranks (which
    posted their receives under this generation's tags)."""
    request_id: str
    generation: int
    prompt: Tokens
    #: The decode side's block table for the prompt's KV (``blocks_for(len(prompt),
    #: block_size)`` ids); empty for a spec without KV.
    kv_blocks: tuple[int, ...] = ()
    #: False: the prefill node neither starts this request from its cache nor keeps its
    #: checkpoints (the decode node's ``--no-enable-prefix-caching``). Protocol 13.
    prefix_cache: bool = True


@message
class TransferTimes(Message):
    """Prefill -> decode, once every prefill rank's sends of a request completed: when its
    events happened on the prefill ranks (wall-clock seconds, see :class:`RankDone`): the
    first rank's compute began (``computed_from``), the last rank's state was final
    (``state_final_at``), the first byte was posted (``posted_at``). The decode node's
    queue, prefill and transfer metrics come from them; nothing waits for this message."""
    BATCH = True
    request_id: str
    generation: int
    computed_from: float
    state_final_at: float
    posted_at: float
    #: Prompt tokens that came from the prefill node's prefix cache (not computed). Protocol 13.
    cached_tokens: int = 0


@message
class PrefixAnnounce(Message):
    """Prefill -> decode, with the heartbeat when something changed (and in full after the
    handshake: ``reset``): the checkpoints the prefill node's cache holds, as keys (see
    :class:`GroupInfo` ``prefix_*``) with their token counts, added and removed since the
    last announcement of ``seq`` order; and what its cache pools hold. A decode node routes by
    it; a stale entry costs one miss, never a wrong token (the prefill node looks up again)."""
    node_id: str
    seq: int
    reset: bool
    added_keys: tuple[bytes, ...] = ()
    added_tokens: tuple[int, ...] = ()
    removed_keys: tuple[bytes, ...] = ()
    pages_cached: int = 0
    blocks_cached: int = 0
    evictions: int = 0


@message
class TransferFailed(Message):
    """Either way: the request's transfer failed; ``kind`` is a TransferError kind."""
    request_id: str
    generation: int
    kind: str
    message: str


@message
class Abort(Message):
    """Either way: stop working on the request and release what it holds."""
    request_id: str
    generation: int
    reason: str


@message
class TransferDigest(Message):
    """Prefill -> decode, only to a decode group that verifies transfers: the digest
    (:mod:`~statebridge.connector.rank.digest`) of the bytes each decode rank receives for the
    request, by decode rank -- the sums of what every prefill rank sends it. The decode
    coordinator compares them with its ranks' digests of what landed (``RankDone.digest``)
    before the request is ready."""
    request_id: str
    generation: int
    digests: tuple[int, ...]


@message
class Heartbeat(Message):
    """Every connection, both ways, every ``heartbeat_interval``: the sender is alive.
    ``seq`` counts the sender's heartbeats on that connection (informational)."""
    node_id: str
    seq: int


@message
class Error(Message):
    """Reply to a message that could not be accepted (the sender keeps its connection)."""
    kind: str
    message: str


@message
class Goodbye(Message):
    """Clean shutdown of a node: its peers fail what is in flight without waiting."""
    node_id: str


# -- inside a group (coordinator <-> rank processes) -------------------------------------------

@message
class RankHello(Message):
    """Rank -> its coordinator at start: who it is and its UCX worker address."""
    tp_rank: int
    address: bytes
    pid: int
    #: The rank's page buffer as a memfd a same-host reader may map (-1: not shared).
    shm_fd: int = -1
    #: What its model's weights cost the rank process beside its buffer: private bytes (the
    #: tensors it holds) and resident bytes of checkpoint files it maps.
    weights_private: int = 0
    weights_mapped: int = 0
    #: Its model prefills a prompt in chunks from a state (``RankModel.chunked_prefill``): what
    #: a prefix cache hit needs. Protocol 13.
    chunked_prefill: bool = False


@message
class RankPrefill(Message):
    """Prefill coordinator -> rank: compute the state of ``prompt`` into ``src_page`` and send
    it to the ranks of decode node ``peer_node``."""
    BATCH = True
    request_id: str
    generation: int
    prompt: Tokens
    src_page: int
    peer_node: str
    #: KV of the first ``kv_tokens`` tokens: computed into ``src_blocks``, sent to the
    #: decode ranks' ``dst_blocks`` (empty without KV).
    src_blocks: tuple[int, ...] = ()
    dst_blocks: tuple[int, ...] = ()
    kv_tokens: int = 0
    #: Prefix cache (protocol 13). A hit: the first ``cached_tokens`` tokens are not computed;
    #: their recurrent state is copied from page ``restore_page`` into ``src_page`` and their
    #: KV from ``restore_blocks`` into ``src_blocks[:len(restore_blocks)]`` (the full blocks,
    #: then the partial tail block) before the first step.
    cached_tokens: int = 0
    restore_page: int = -1
    restore_blocks: tuple[int, ...] = ()
    #: Checkpoints to keep: after the step that computed token ``checkpoint_at[i]``, the
    #: request's page is copied to ``checkpoint_pages[i]`` and, where that count is not a
    #: multiple of the block size, its partial block ``src_blocks[n // block_size]`` to
    #: ``checkpoint_tails[i]`` (-1: none). Steps end at these counts.
    checkpoint_at: tuple[int, ...] = ()
    checkpoint_pages: tuple[int, ...] = ()
    checkpoint_tails: tuple[int, ...] = ()


@message
class RankRecv(Message):
    """Decode coordinator -> rank: post the receives of a request from prefill node
    ``peer_node`` into ``page``, and with ``blocks`` (the request's KV block table, KV of
    ``kv_tokens`` tokens) the KV receives too (the source table is one contiguous range)."""
    BATCH = True
    request_id: str
    generation: int
    page: int
    peer_node: str
    blocks: tuple[int, ...] = ()
    kv_tokens: int = 0


@message
class RankDone(Message):
    """Rank -> coordinator: this rank finished its part (``kind`` empty) or failed it (``kind``
    a :class:`~statebridge.errors.FailureKind` name; ``message`` says why). Sent once per
    request, only when nothing of it can still touch the page. ``nbytes``: payload bytes the
    rank moved for the request (recurrent state and KV; the decode node's transfer-size
    metric sums them over its ranks).

    When the rank's part succeeded it says when its events happened, where they happened
    (wall-clock seconds since the epoch, taken from the machine's monotonic clock: the
    processes of one machine agree to microseconds, other machines up to their clock
    offset; 0.0 where the rank had no such event): a rank that computed the request
    (prefill rank; decode rank for a local prefill) ``computed_from`` (its compute began)
    and ``state_final_at``; a prefill rank ``posted_at`` (its first byte posted); a decode
    rank ``landed_at`` (every byte of the request it receives had landed)."""
    BATCH = True
    tp_rank: int
    peer_node: str
    request_id: str
    generation: int
    kind: str
    message: str
    nbytes: int = 0
    computed_from: float = 0.0
    state_final_at: float = 0.0
    posted_at: float = 0.0
    landed_at: float = 0.0
    #: A decode rank of a verified link: the digest of what landed for the request (-1: none).
    digest: int = -1


@message
class RankDigest(Message):
    """Prefill rank -> coordinator, for a decode group that verifies transfers: the digest of
    the bytes this rank sends each decode rank for the request (``digests[r]``: decode rank
    ``r``; 0 for a rank it sends nothing), computed once the state is final."""
    BATCH = True
    tp_rank: int
    peer_node: str
    request_id: str
    generation: int
    digests: tuple[int, ...]


#: The values of the instrumentation switch, ``RankSetup.probes`` (see :class:`RankProbe`).
PROBES = ("", "timing", "checksums")


@message
class RankProbe(Message):
    """Rank -> coordinator, only from an instrumented rank: what a benchmark or a test measures
    or verifies of one request on this rank. The product never sends or reads it; the
    benchmark and the tests receive it through :meth:`RankGroup.on_rank_message
    <statebridge.connector.group.RankGroup.on_rank_message>`
    (:class:`statebridge.testing.probes.Probes`).

    The instrumentation switch is ``RankSetup.probes`` (``RankGroup(probes=...)``), one of
    :data:`PROBES`; this is the one place its meaning is written:

    - ``""`` (the default, the product): no probes; a rank answers each request with its
      ``RankDone`` alone.
    - ``"timing"``: every rank sends a ``RankProbe`` for each request whose transfers it
      settled (not for a local prefill, nor for a request that failed before anything was
      posted), just before that request's ``RankDone`` (so a probe is in by the time the
      coordinator reports the request): ``seconds`` from posting to settling on this rank,
      ``messages`` (data-plane messages this rank moved for it), ``staging_bytes`` (the rank's
      staging counter, total since it started), ``state_final_at`` (a prefill rank: when the
      model's state of the request was final) or ``held_at`` (a decode rank: when it held all
      of it) -- ``time.monotonic()``, CLOCK_MONOTONIC, one clock for every process of a machine;
      0 for a request that failed.
    - ``"checksums"``: as ``"timing"``, and a decode rank also hashes what it received for a
      request that succeeded: ``checksum``
      (:func:`~statebridge.state.cache.page_checksum` of its page) and, for a request with
      KV, ``kv_checksum`` (:func:`~statebridge.connector.rank.kv_checksum`) -- a pass over
      the request's bytes before the rank answers.
    """
    BATCH = True
    tp_rank: int
    peer_node: str
    request_id: str
    generation: int
    seconds: float
    messages: int
    staging_bytes: int
    state_final_at: float = 0.0
    held_at: float = 0.0
    checksum: str = ""
    kv_checksum: str = ""


@message
class RankCancel(Message):
    """Coordinator -> rank: cancel the request's transfers; reply RankDone once nothing of it
    can still touch the page. ``lost_node`` (may be empty) names a dead peer node whose
    endpoints the rank must fail."""
    BATCH = True
    peer_node: str
    request_id: str
    generation: int
    kind: str
    reason: str
    lost_node: str


@message
class RankShutdown(Message):
    reason: str


@message
class RankLocalPrefill(Message):
    """Decode coordinator -> rank: compute the state of ``prompt`` into ``page`` locally (the
    ``recompute`` failure policy); answered with RankDone."""
    request_id: str
    generation: int
    prompt: Tokens
    page: int
    blocks: tuple[int, ...] = ()        # the KV of ``prompt`` goes here (spec with KV)


@message
class RankTransports(Message):
    """Rank -> coordinator, once per peer group it connected to: the transports (``tl/device``
    as UCX names them, e.g. ``cma/memory``, ``cuda_ipc/cuda``, ``tcp/eth0``) UCX chose for
    each peer rank (``peer_ranks[i]`` over ``lanes[i]``, comma-separated; "" when UCX did not
    say), and why device memory sent to another host would go through host memory
    (``host_staging``, "" when it would not). The node shows them in its stats."""
    tp_rank: int
    peer_node: str
    peer_ranks: tuple[int, ...]
    lanes: tuple[str, ...]
    host_staging: str = ""


@message
class RankFailed(Message):
    """Rank -> coordinator: the rank could not start (its model, checkpoint or UCX failed);
    ``message`` is the error. The rank process exits after sending it."""
    tp_rank: int
    message: str
