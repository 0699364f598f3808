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
    - ``lease_timeout``: how long a prefill page is held for a decode side that never confirms.
    - ``transfer_timeout``: bound on one request's transfer once both sides work on it.
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

    Supervision of the rank group (:class:`~statebridge.connector.group.RankGroup`):

    - ``on_rank_loss``: what a node whose rank died (or went silent for ``peer_timeout``)
      does: ``restart`` its whole rank group (in-flight requests fail with ``peer_lost``;
      pages, KV blocks and the ledger are reset once every old rank process is gone; peers
      re-handshake), or ``exit``: the group is failed (:attr:`RankGroup.fatal
      <statebridge.connector.group.RankGroup.fatal>`) and the node's command exits non-zero
      for its supervisor (systemd, Kubernetes) to restart it. A restart that fails, or the
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
      ``block_size`` tokens per block (the same on both nodes), and its size: ``kv_blocks``
      blocks per rank, or (``kv_blocks = 0``) as many as fit in ``kv_memory`` bytes per rank.
    - ``front_door``: the decode node's zmq front door (``--front-door``): ``on`` listens on
      ``bind_host:port``; ``off`` does not listen (HTTP only); ``auto`` (the default) listens
      unless the HTTP API requires an API key while the control plane has no CURVE keys --
      then the zmq door would let anyone who reaches the port generate without the key.
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
    kv_memory: int = 256 << 20
    front_door: str = "auto"

    def __post_init__(self) -> None:
        for name in ("num_pages", "max_batch", "max_prompt_len", "max_new_tokens",
                     "block_size", "kv_memory"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.kv_blocks, int) or isinstance(self.kv_blocks, bool) or \
                self.kv_blocks < 0:
            raise ConfigError(f"kv_blocks must be a non-negative integer (0: from kv_memory), "
                              f"got {self.kv_blocks!r}")
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

    def num_blocks(self, spec, tp_size: int) -> int:
        """KV blocks per rank for ``spec`` at ``tp_size``: ``kv_blocks``, else as many as
        ``kv_memory`` holds (ConfigError when not even one fits); 0 without attention KV."""
        if spec.kv is None:
            return 0
        if self.kv_blocks:
            return self.kv_blocks
        from statebridge.state.kv import BlockGeometry

        per_block = BlockGeometry(spec.kv, tp_size, self.kv_layout, self.block_size, 1).nbytes
        if self.kv_memory < per_block:
            raise ConfigError(f"kv_memory={self.kv_memory} bytes holds no KV block of "
                              f"{per_block} bytes ({self.block_size} tokens at TP {tp_size})")
        return self.kv_memory // per_block

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
