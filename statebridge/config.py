"""Configuration as frozen dataclasses; :meth:`ConnectorConfig.from_env` is the only reader of
``STATEBRIDGE_*`` environment variables. CLI flags map onto the same fields."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Mapping

from statebridge.errors import ConfigError

__all__ = ["ConnectorConfig", "NodeConfig", "HttpConfig", "AB_SWITCHES"]

#: Fields of :class:`ConnectorConfig` that are not settings but experimental A/B switches,
#: owned by the benchmark harness: :mod:`statebridge.bench.ab` says what each one compares.
#: No CLI flag and no ``STATEBRIDGE_*`` variable sets them (:meth:`ConnectorConfig.from_env`
#: refuses those variables).
AB_SWITCHES = ("local_ranks", "shared_map", "batched_prefill")


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """Timeouts and limits of the connector (seconds, bytes, counts).

    - ``heartbeat_interval``: how often every control connection says it is alive.
    - ``peer_timeout``: silence after which a peer (node or rank) is declared lost; requests it
      touched fail with PeerLostError within about this bound.
    - ``lease_timeout``: how long a prefill rank holds a request's final state (from when its
      sends are posted) for a decode side that does not take it.
    - ``transfer_timeout``: bound on a decode rank's wait for one request's state, from when it
      posts its receives (at submit: prefill queueing and compute count).
    - ``ucx_error_handling``: UCX endpoint error handling (detects dead peers itself, but UCX then
      skips shared memory for TCP, several times slower on one host); heartbeats work either way.
    - ``bind_host``: the address every listening control socket binds (``0.0.0.0`` / ``::``
      only if you mean it: a warning is logged).
    - ``keys_dir``: a directory written by ``statebridge keygen``; when set, every control socket
      uses CurveZMQ and listening sockets admit only the public keys in it (see
      :mod:`statebridge.security`). ``key_name``: the key pair this process dials with.
    - ``send_reap_interval``: how long a prefill rank may sleep through the completions of
      sends that its receivers read by themselves (same host, shared memory) before it reaps
      them -- so a freed prefill page waits at most this much longer -- used only while sends
      finish at least that often (see :meth:`RankWorker._before_sleep
      <statebridge.connector.rank.RankWorker._before_sleep>`). 0: a rank always wakes for
      each completion. Also how often a prefill rank looks at the answer words of its
      shared-map readers while answers are due (0: every millisecond): an answer is a word
      in its memory, which wakes nobody.
    - ``shared_map_min_bytes``: on one host a decode rank copies its runs out of a read-only
      mapping of the prefill rank's buffer (a memfd; :mod:`statebridge.connector.data.shared`)
      instead of receiving them over UCX's cma rendezvous. For a spec without attention KV,
      only rank pairs whose recurrent runs are at least this long per request go that way
      (the prefill group's value holds; a prefill rank whose page is smaller keeps huge-page
      memory): below it the copy saves less than the notice and the answer cost. A hybrid
      link (both groups hold KV pools) moves its KV and every zero-copy recurrent pair through
      the map, whatever their size: one notice per rank pair covers both. Results:
      docs/measurements.md, "Data plane on one host".

    - ``verify_transfers``: end-to-end transfer verification. A prefill node computes a
      digest of the bytes each decode rank receives per request
      (:mod:`statebridge.connector.rank.digest`) and sends it along; a decode rank digests
      what landed in its page and KV blocks before the request's first step, and a mismatch
      fails that request (``transfer_error``, naming the request, the rank and both values;
      the ``recompute`` policy recomputes it) and is counted. Off by default (nothing is
      computed). Both nodes say it in the handshake: a decode node that verifies refuses a
      prefill node that does not send digests (``IncompatiblePeerError`` naming the flag); a
      prefill node that sends digests computes them only for decode nodes that verify.

    Supervision of the rank group (:class:`~statebridge.connector.group.RankGroup`):

    - ``on_rank_loss``: what a node whose rank died (or went silent for ``peer_timeout``)
      does: ``restart`` its whole rank group (in-flight requests fail with ``peer_lost``;
      pages, KV blocks and the ledger are reset once every old rank process is gone; peers
      re-handshake), or ``exit``: the group is failed (a coordinator's ``fatal``, its
      :attr:`Supervisor.fatal <statebridge.connector.supervision.Supervisor.fatal>`) and the
      node's command exits non-zero for its supervisor (systemd, Kubernetes) to restart it. A restart that fails, or the
      ``max_rank_restarts + 1``-th within ``rank_restart_window`` seconds, fails the group
      the same way.
    - ``max_prefill_tokens``: the token budget of one prefill step on a rank: queued prompts
      run together as one varlen forward of at most this many tokens; a longer prompt runs in
      chunks over several steps (its state and KV carry over), and each request's transfer
      starts as soon as the step holding its last token is done. The knob of vLLM's
      ``max_num_batched_tokens``: larger batches use the device better, smaller ones bound how
      long a queued short prompt waits behind long ones.
    - ``rank_start_timeout``: bound on a rank group's start (every rank announced itself:
      model loaded, TP rendezvous done), at node start and at each restart.

    Not settings: ``local_ranks``, ``shared_map`` and ``batched_prefill`` (:data:`AB_SWITCHES`) are experimental
    A/B switches that turn a fast path off to compare it with the path it replaced; the
    benchmark harness owns them and :mod:`statebridge.bench.ab` documents them. Leave them on.
    """

    ON_RANK_LOSS = ("restart", "exit")

    bind_host: str = "127.0.0.1"
    heartbeat_interval: float = 0.5
    peer_timeout: float = 3.0
    lease_timeout: float = 30.0
    transfer_timeout: float = 60.0
    handshake_timeout: float = 10.0
    ucx_error_handling: bool = False
    max_message_bytes: int = 16 * 1024 * 1024
    max_inflight_per_peer: int = 1024
    torch_threads: int = 1
    keys_dir: str = ""
    key_name: str = "node"
    send_reap_interval: float = 0.005
    shared_map_min_bytes: int = 4 << 20
    on_rank_loss: str = "restart"
    rank_start_timeout: float = 120.0
    max_prefill_tokens: int = 2048
    max_rank_restarts: int = 3
    rank_restart_window: float = 600.0
    verify_transfers: bool = False
    # -- experimental A/B switches, not settings (AB_SWITCHES; statebridge.bench.ab) --------
    local_ranks: bool = True
    shared_map: bool = True
    batched_prefill: bool = True

    def __post_init__(self) -> None:
        for name in ("heartbeat_interval", "peer_timeout", "lease_timeout", "transfer_timeout",
                     "handshake_timeout", "rank_start_timeout", "rank_restart_window"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")
        if isinstance(self.send_reap_interval, bool) \
                or not isinstance(self.send_reap_interval, (int, float)) \
                or not 0 <= self.send_reap_interval <= self.heartbeat_interval:
            raise ConfigError(f"send_reap_interval must be 0 to heartbeat_interval "
                              f"({self.heartbeat_interval}) seconds, got "
                              f"{self.send_reap_interval!r}")
        if self.peer_timeout <= self.heartbeat_interval:
            raise ConfigError(f"peer_timeout {self.peer_timeout} must exceed heartbeat_interval "
                              f"{self.heartbeat_interval}")
        for name in AB_SWITCHES:
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if isinstance(self.shared_map_min_bytes, bool) \
                or not isinstance(self.shared_map_min_bytes, int) or self.shared_map_min_bytes < 0:
            raise ConfigError(f"shared_map_min_bytes must be a non-negative integer, got "
                              f"{self.shared_map_min_bytes!r}")
        if self.on_rank_loss not in self.ON_RANK_LOSS:
            raise ConfigError(f"on_rank_loss must be one of {self.ON_RANK_LOSS}, got "
                              f"{self.on_rank_loss!r}")
        if not isinstance(self.verify_transfers, bool):
            raise ConfigError(f"verify_transfers must be a bool, got {self.verify_transfers!r}")
        if isinstance(self.max_rank_restarts, bool) or not isinstance(self.max_rank_restarts, int) \
                or self.max_rank_restarts < 0:
            raise ConfigError(f"max_rank_restarts must be a non-negative integer, got "
                              f"{self.max_rank_restarts!r}")
        for name in ("max_message_bytes", "max_inflight_per_peer", "torch_threads",
                     "max_prefill_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.bind_host, str) or not self.bind_host:
            raise ConfigError(f"bind_host must be a host name or address, got {self.bind_host!r}")
        if not isinstance(self.keys_dir, str):
            raise ConfigError(f"keys_dir must be a directory path, got {self.keys_dir!r}")
        if self.keys_dir:
            _check_keys(self.keys_dir, self.key_name)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides) -> "ConnectorConfig":
        """Defaults, then ``STATEBRIDGE_<FIELD>`` variables, then ``overrides``. The A/B switches
        (:data:`AB_SWITCHES`) are no settings: their variables raise :class:`ConfigError`."""
        environ = os.environ if environ is None else environ
        values = {}
        for f in dataclasses.fields(cls):
            key = f"STATEBRIDGE_{f.name.upper()}"
            if key not in environ:
                continue
            if f.name in AB_SWITCHES:
                raise ConfigError(f"{key}={environ[key]!r}: {f.name} is not a setting but an "
                                  f"A/B switch of the benchmark harness (statebridge bench "
                                  f"--off {f.name}; see statebridge/bench/ab.py)")
            text = environ[key]
            default = f.default
            try:
                if isinstance(default, bool):
                    if text.lower() not in ("1", "0", "true", "false", "yes", "no"):
                        raise ValueError(text)
                    values[f.name] = text.lower() in ("1", "true", "yes")
                else:
                    values[f.name] = type(default)(text)
            except ValueError:
                raise ConfigError(f"{key}={text!r} is not a valid {type(default).__name__}") from None
        values.update(overrides)
        return cls(**values)

    def replace(self, **changes) -> "ConnectorConfig":
        return dataclasses.replace(self, **changes)


#: Max-length requests the default KV pool of a node holds (NodeConfig.kv_tokens_default).
DEFAULT_KV_REQUESTS = 4


def _physical_memory() -> int:
    """Bytes of memory of this machine (0 when unknown)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """What a node serves with, beside its connector settings (the CLI's node flags).

    - ``layout``: the page layout of the node's ranks; ``num_pages``: pages per rank (requests
      in flight).
    - ``max_batch``: requests per decode step; ``max_prompt_len`` / ``max_new_tokens``: the
      largest request the decode node accepts (larger: ``invalid_request``).
    - ``policy``: what the decode node does when a transfer fails: ``fail`` (the client gets the
      typed error) or ``recompute`` (the decode ranks prefill the prompt themselves).
    - ``rank_model``: ``module:Class`` of the RankModel every rank runs.
    - Attention KV (models with attention layers): ``kv_layout`` of each rank's block pool,
      ``block_size`` tokens per block (the same on both nodes), and its size, at most one of:
      ``kv_tokens`` tokens per node (every rank of the node holds them, its share of the KV
      heads), ``kv_gib`` GiB per node (split evenly over its ranks), ``kv_blocks`` blocks per
      rank, or ``kv_memory`` bytes per rank (deprecated: the tokens it holds depend on the TP
      size). None given: :data:`DEFAULT_KV_REQUESTS` max-length requests (``max_prompt_len +
      max_new_tokens`` tokens each) per node, at any TP (:meth:`kv_tokens_default`).
    - ``device``: where the ranks compute and hold pages and KV (:mod:`statebridge.devices`:
      ``auto`` -- CUDA when a GPU is visible, else the CPU -- ``cpu``, ``cuda``, ``cuda:N``).
    - ``front_door``: the decode node's zmq front door (``--front-door``): ``on`` listens on
      ``bind_host:port``; ``off`` does not listen (HTTP only); ``auto`` (the default) listens
      unless the HTTP API requires an API key while the control plane has no CURVE keys --
      then the zmq door would let anyone who reaches the port generate without the key.
    - Prefix caching (``--enable-prefix-caching``, on by default): ``prefix_cache`` on either
      node (off on a decode node: it neither asks for hits nor routes by prefix); the prefill
      node's ``prefix_stride`` (recurrent-state checkpoints every that many tokens, default
      256, besides each prompt's end and where prompts branch; 0: none) and
      ``prefix_cache_gib``, the GiB per node (split evenly over its
      ranks) its cached checkpoints and KV blocks may take of its page and KV pools (0: the
      default, half of each pool).
    """

    POLICIES = ("fail", "recompute")
    FRONT_DOORS = ("auto", "on", "off")

    layout: str = "DLS"
    num_pages: int = 64
    max_batch: int = 32
    max_prompt_len: int = 8192
    max_new_tokens: int = 4096
    policy: str = "fail"
    rank_model: str = "statebridge.node.rank_model:ModelRankModel"
    kv_layout: str = "HB"
    block_size: int = 16
    kv_blocks: int = 0
    kv_memory: int = 0
    device: str = "auto"
    front_door: str = "auto"
    kv_tokens: int = 0
    kv_gib: float = 0.0
    prefix_cache: bool = True
    prefix_stride: int = 256
    prefix_cache_gib: float = 0.0

    #: KV pool sizes, one of which may be set (0: not set).
    KV_SIZES = ("kv_tokens", "kv_gib", "kv_blocks", "kv_memory")

    def __post_init__(self) -> None:
        for name in ("num_pages", "max_batch", "max_prompt_len", "max_new_tokens",
                     "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.prefix_stride, int) or isinstance(self.prefix_stride, bool) \
                or self.prefix_stride < 0:
            raise ConfigError(f"prefix_stride must be an integer >= 0 (0: no periodic "
                              f"checkpoints), got {self.prefix_stride!r}")
        for name in ("kv_blocks", "kv_memory", "kv_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{name} must be a positive integer (0: not set), got "
                                  f"{value!r}")
        if isinstance(self.kv_gib, bool) or not isinstance(self.kv_gib, (int, float)) or \
                not 0 <= self.kv_gib < float("inf"):
            raise ConfigError(f"kv_gib must be a positive number of GiB (0: not set), got "
                              f"{self.kv_gib!r}")
        if isinstance(self.prefix_cache_gib, bool) or \
                not isinstance(self.prefix_cache_gib, (int, float)) or \
                not 0 <= self.prefix_cache_gib < float("inf"):
            raise ConfigError(f"prefix_cache_gib must be a positive number of GiB (0: the "
                              f"default), got {self.prefix_cache_gib!r}")
        if not isinstance(self.prefix_cache, bool):
            raise ConfigError(f"prefix_cache must be True or False, got {self.prefix_cache!r}")
        given = [name for name in self.KV_SIZES if getattr(self, name)]
        if len(given) > 1:
            sizes = ", ".join(f"{n}={getattr(self, n)!r}" for n in given)
            raise ConfigError(f"give one KV pool size, got {sizes}")
        if self.front_door not in self.FRONT_DOORS:
            raise ConfigError(f"front_door must be one of {self.FRONT_DOORS}, got "
                              f"{self.front_door!r}")
        if self.policy not in self.POLICIES:
            raise ConfigError(f"unknown failure policy {self.policy!r}; expected one of "
                              f"{self.POLICIES}")
        if not isinstance(self.rank_model, str) or ":" not in self.rank_model:
            raise ConfigError(f"rank_model must be MODULE:CLASS, got {self.rank_model!r}")
        from statebridge.state.layout import Layout

        Layout.parse(self.layout)                  # LayoutError names a bad layout
        from statebridge.state.kv import KVLayout

        KVLayout.parse(self.kv_layout)
        from statebridge.devices import DeviceSpec

        DeviceSpec.parse(self.device)              # ConfigError names a bad spelling

    @property
    def max_model_len(self) -> int:
        """The longest request the limits allow: ``max_prompt_len + max_new_tokens``."""
        return self.max_prompt_len + self.max_new_tokens

    def kv_tokens_default(self) -> int:
        """Tokens of KV per node when no size is given: :data:`DEFAULT_KV_REQUESTS` requests
        of :attr:`max_model_len` tokens. The same at every TP on both nodes of a pair: a
        request's blocks hold the same tokens on every rank (each rank its heads), so sizing
        in tokens never leaves the lower-TP side with fewer tokens than its peer."""
        return DEFAULT_KV_REQUESTS * self.max_model_len

    def num_blocks(self, spec, tp_size: int, *, physical_memory: int | None = None) -> int:
        """KV blocks per rank for ``spec`` at ``tp_size`` from the one KV size given (see the
        class docstring), 0 without attention KV. ConfigError naming the value when not even
        one block fits, or when the node's pools would exceed ``physical_memory`` (default:
        this machine's memory)."""
        if spec.kv is None:
            return 0
        from statebridge.state.kv import BlockGeometry

        per_block = BlockGeometry(spec.kv, tp_size, self.kv_layout, self.block_size, 1).nbytes
        if self.kv_blocks:
            what, blocks = f"kv_blocks={self.kv_blocks}", self.kv_blocks
        elif self.kv_memory:
            what, blocks = f"kv_memory={self.kv_memory} bytes", self.kv_memory // per_block
        elif self.kv_gib:
            what = f"kv_gib={self.kv_gib:g}"
            blocks = int(self.kv_gib * (1 << 30)) // tp_size // per_block
        else:
            tokens = self.kv_tokens or self.kv_tokens_default()
            what = f"kv_tokens={tokens}" if self.kv_tokens else \
                f"the default KV pool of {tokens} tokens"
            blocks = -(-tokens // self.block_size)
        if blocks < 1:
            raise ConfigError(f"{what} holds no KV block of {per_block} bytes "
                              f"({self.block_size} tokens at TP {tp_size})")
        memory = _physical_memory() if physical_memory is None else physical_memory
        node_bytes = blocks * per_block * tp_size
        if memory and node_bytes > memory:
            raise ConfigError(f"{what}: {blocks} KV blocks per rank x {per_block} bytes x TP "
                              f"{tp_size} = {node_bytes} bytes exceeds this machine's memory "
                              f"of {memory} bytes")
        return blocks

    def replace(self, **changes) -> "NodeConfig":
        """A copy with the given fields changed; None leaves a field as it is (unset flags)."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})


@dataclass(frozen=True, slots=True)
class HttpConfig:
    """The decode node's OpenAI-compatible HTTP front door (``statebridge decode --http-port``).

    - ``port``: None serves no HTTP; 0 picks a free port.
    - ``host``: the address it binds; empty: the node's ``bind_host``.
    - ``api_key``: when set, ``/v1/*`` requires ``Authorization: Bearer <api_key>``
      (``STATEBRIDGE_API_KEY``); ``/health`` and ``/metrics`` stay open, as in vLLM.
    - ``served_model_name``: the model's name in ``/v1/models`` and requests; empty: the
      checkpoint directory's name.
    - ``max_inflight``: HTTP generations at once; beyond it 429 with ``Retry-After`` (0: four
      times the node's pages).
    - ``default_max_tokens``: ``max_tokens`` of a request that gives none (OpenAI's 16).
    - ``node_timeout``: seconds without a word from the decode node before a request fails.
    - ``max_body_bytes``: the largest request body read (``--max-body-bytes``); a larger one
      is refused with 413 from its ``Content-Length``, or as soon as that much arrived,
      never buffered whole. It also bounds the one step that holds the interpreter lock for
      a whole body (parsing its JSON), so it bounds how long one request can stall the node.
    - ``header_timeout``: seconds a connection has to send a whole request head, from its
      opening or from its previous response (slow clients are closed with 408).
    - ``body_timeout``: seconds to read a request's whole body once its head came (408).
    """

    port: int | None = None
    host: str = ""
    api_key: str = ""
    served_model_name: str = ""
    max_inflight: int = 0
    default_max_tokens: int = 16
    node_timeout: float = 120.0
    max_body_bytes: int = 1 << 20
    header_timeout: float = 10.0
    body_timeout: float = 30.0

    def __post_init__(self) -> None:
        if self.port is not None and (not isinstance(self.port, int) or
                                      isinstance(self.port, bool) or not 0 <= self.port < 65536):
            raise ConfigError(f"http port must be in [0, 65535], got {self.port!r}")
        for name in ("host", "api_key", "served_model_name"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"{name} must be a string, got {getattr(self, name)!r}")
        for name in ("max_inflight", "default_max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0 or (
                    name == "default_max_tokens" and value == 0):
                raise ConfigError(f"{name} must be a {'positive' if name[0] == 'd' else 'non-negative'} "
                                  f"integer, got {value!r}")
        for name in ("node_timeout", "header_timeout", "body_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    not 0 < value < float("inf"):
                raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")
        if isinstance(self.max_body_bytes, bool) or not isinstance(self.max_body_bytes, int) \
                or self.max_body_bytes < 1024:
            raise ConfigError(f"max_body_bytes must be an integer of at least 1024, got "
                              f"{self.max_body_bytes!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides) -> "HttpConfig":
        """Defaults, then ``STATEBRIDGE_API_KEY`` and ``STATEBRIDGE_SERVED_MODEL_NAME``, then
        the ``overrides`` that are not None (unset flags)."""
        environ = os.environ if environ is None else environ
        values = {name: environ[f"STATEBRIDGE_{name.upper()}"]
                  for name in ("api_key", "served_model_name")
                  if f"STATEBRIDGE_{name.upper()}" in environ}
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def replace(self, **changes) -> "HttpConfig":
        return dataclasses.replace(self, **changes)


def _check_keys(keys_dir: str, key_name: str) -> None:
    """The files a keyed process needs exist (their contents are read where sockets are made)."""
    from statebridge.security import SERVER_NAME, check_key_name, key_files

    check_key_name(key_name)
    if not os.path.isdir(keys_dir):
        raise ConfigError(f"keys_dir {keys_dir!r} does not exist or is not a directory "
                          f"(create it with `statebridge keygen {keys_dir}`)")
    for path in (key_files(keys_dir, key_name)[1], key_files(keys_dir, SERVER_NAME)[0]):
        if not os.path.isfile(path):
            raise ConfigError(f"keys_dir {keys_dir!r} lacks {path} (create it with "
                              f"`statebridge keygen {keys_dir} --name {key_name}`)")
