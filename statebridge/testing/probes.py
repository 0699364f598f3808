"""What instrumented ranks report, collected for benchmarks and tests.

A group started with ``probes="timing"`` or ``probes="checksums"`` (the instrumentation switch;
its meaning is written once, in :class:`~statebridge.connector.messages.RankProbe`) has every
rank send a ``RankProbe`` just before the ``RankDone`` of each request it settled. A
:class:`Probes` attached to the groups keeps them, by group and request, so that once a
request is reported (its future resolved, its ``on_done`` run) all its probes are in.
:func:`instrumented` attaches one to a group where it is made (``with instrumented(
DecodeCoordinator(..., probes="checksums")) as decode:``); :func:`probes_of` finds it again.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, TypeVar

from statebridge.connector import messages as m
from statebridge.errors import ConfigError

if TYPE_CHECKING:
    from statebridge.connector.group import RankGroup

__all__ = ["Probes", "instrumented", "probes_of"]

#: group -> the Probes attached to it last
_attached: "weakref.WeakKeyDictionary[RankGroup, Probes]" = weakref.WeakKeyDictionary()
G = TypeVar("G")


class Probes:
    """The ``RankProbe`` messages of ``groups`` (rank groups started with ``probes`` on, or
    the coordinators that hold them):
    attached through :meth:`RankGroup.on_rank_message
    <statebridge.connector.group.RankGroup.on_rank_message>`, so create it before the groups
    serve requests. Any thread may read it.

    A request is named by its id (the newest attempt), or by a ``TransferResult`` (its
    attempt); ``group`` picks a group when the probes of several are kept (the first one
    attached by default). The probes of the newest ``keep`` request ids of each group are
    kept (a long run does not grow without bound).
    """

    def __init__(self, *groups: "RankGroup", keep: int = 1 << 16) -> None:
        groups = tuple(_group_of(g) for g in groups)
        if not groups:
            raise ConfigError("Probes needs at least one group to listen to")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ConfigError(f"keep must be a positive number of requests, got {keep!r}")
        self.keep = keep
        self._lock = threading.Lock()
        #: node id -> request id -> generation -> rank -> probe
        self._by_node: dict[str, dict[str, dict[int, dict[int, m.RankProbe]]]] = {}
        self._sizes: dict[str, int] = {}
        self._first = groups[0].node_id
        #: Probes received so far, every group together.
        self.received = 0
        for group in groups:
            self._by_node[group.node_id] = {}
            self._sizes[group.node_id] = group.tp_size
            group.on_rank_message(m.RankProbe, self._handler(group.node_id))
            _attached[group] = self

    def _handler(self, node_id: str):
        requests = self._by_node[node_id]

        def on_probe(rank: int, msg: m.RankProbe) -> None:
            with self._lock:
                attempts = requests.get(msg.request_id)
                if attempts is None:
                    attempts = requests[msg.request_id] = {}
                    if len(requests) > self.keep:
                        del requests[next(iter(requests))]         # the oldest request id
                attempts.setdefault(msg.generation, {})[rank] = msg
                self.received += 1
        return on_probe

    # -- reading -------------------------------------------------------------------------------
    def of(self, request, group: "RankGroup | str | None" = None) -> tuple[m.RankProbe, ...]:
        """The probes of ``request`` (an id, or a result with ``request_id`` and
        ``generation``) from every rank of ``group``, rank 0 first; ConfigError naming the
        request when a rank's probe is missing."""
        node = self._node(group)
        rid = request if isinstance(request, str) else request.request_id
        with self._lock:
            attempts = self._by_node[node].get(rid, {})
            if isinstance(request, str):
                by_rank = attempts[next(reversed(attempts))] if attempts else {}
            else:
                by_rank = attempts.get(request.generation, {})
            by_rank = dict(by_rank)
        missing = [r for r in range(self._sizes[node]) if r not in by_rank]
        if missing:
            raise ConfigError(f"no probe of {rid!r} from ranks {missing} of {node} (is the "
                              f"group started with probes on?)")
        return tuple(by_rank[r] for r in range(self._sizes[node]))

    def checksums(self, request, group=None) -> tuple[str, ...]:
        """Each rank's page checksum of ``request`` (decode ranks, ``probes="checksums"``)."""
        return tuple(p.checksum for p in self.of(request, group))

    def kv_checksums(self, request, group=None) -> tuple[str, ...]:
        """Each rank's KV checksum of ``request`` (decode ranks, a request with KV)."""
        return tuple(p.kv_checksum for p in self.of(request, group))

    def rank_seconds(self, request, group=None) -> tuple[float, ...]:
        """Each rank's seconds from posting ``request``'s transfers to settling them."""
        return tuple(p.seconds for p in self.of(request, group))

    def messages(self, request, group=None) -> int:
        """Data-plane messages ``request`` took, every rank of ``group`` together."""
        return sum(p.messages for p in self.of(request, group))

    def held_at(self, request, group=None) -> float:
        """``time.monotonic()`` when the last decode rank held ``request``'s state."""
        return max(p.held_at for p in self.of(request, group))

    def state_final_at(self, request, group=None) -> float:
        """``time.monotonic()`` when the last prefill rank's state of ``request`` was final."""
        return max(p.state_final_at for p in self.of(request, group))

    def staging_bytes(self, group=None) -> list[int]:
        """Each rank's staging counter as its newest probe says (0 before any probe)."""
        node = self._node(group)
        out = [0] * self._sizes[node]
        with self._lock:
            for attempts in self._by_node[node].values():
                for by_rank in attempts.values():
                    for rank, p in by_rank.items():
                        out[rank] = max(out[rank], p.staging_bytes)
        return out

    def clear(self) -> None:
        """Forget every probe kept so far."""
        with self._lock:
            for requests in self._by_node.values():
                requests.clear()

    def _node(self, group) -> str:
        node = self._first if group is None else group if isinstance(group, str) \
            else group.node_id
        if node not in self._by_node:
            raise ConfigError(f"no probes kept of group {node!r}; kept: {list(self._by_node)}")
        return node


def _group_of(holder):
    """The rank group of a coordinator (its ``group``), or ``holder`` itself."""
    return getattr(holder, "group", holder)


def instrumented(group: G) -> G:
    """``group`` with a :class:`Probes` attached (:func:`probes_of` returns it)."""
    Probes(group)
    return group


def probes_of(group: "RankGroup") -> Probes:
    """The :class:`Probes` attached to ``group`` last; ConfigError when none is."""
    try:
        return _attached[_group_of(group)]
    except KeyError:
        raise ConfigError(f"no Probes attached to {group.node_id}") from None
