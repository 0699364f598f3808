"""Same-host shared-map reads: the decode rank copies a request's runs out of a read-only map
of the prefill rank's buffer instead of receiving them over UCX.

On one host UCX moves a large message as a cma rendezvous: the receiver copies it out of the
sender's memory with ``process_vm_readv``, which pins and copies 4 KiB at a time in the kernel.
Copying out of a map of the sender's buffer with streaming stores is faster per core. It is the
CPU analogue of what UCX's ``cuda_ipc`` does between GPUs of one node: map the peer's memory,
copy with the local engine.

The receiver stays in control of its memory: only the decode rank writes into its pages, with
its own code, into a request it announced; the prefill rank never writes anywhere but its own
buffer. The prefill side holds its page until every reader said it is done, exactly as long as
it held it for UCX's reads.

One concern per module:

- ``buffer``: :class:`SharedBuffer` (a memfd buffer), :class:`PeerMap` (a peer's, mapped),
  :func:`copy_groups` / :func:`copy_runs` (the C copy, ``_copy.c``), :func:`available`,
  :func:`streaming`, :func:`process_alive`;
- ``notice``: the notice slot -- its named words, and how a notice is written, read and
  answered (:class:`NoticeSlot`, :class:`Notice`, :class:`NoticeSlots`);
- ``eligibility``: which pairs go this way, ONE rule (:func:`map_threshold` of two
  :class:`MapSide`\\ s) for a prefill rank's buffer, its coordinator's ``GroupInfo`` and both
  ranks of a link.

UCX carries the notices (tag index ``READY_INDEX``); the rank (``connector/rank/``) posts them,
copies and answers.
"""

from statebridge.connector.data.shared.buffer import (
    PeerMap,
    SharedBuffer,
    available,
    copy_groups,
    copy_runs,
    process_alive,
    streaming,
)
from statebridge.connector.data.shared.eligibility import MapSide, map_threshold
from statebridge.connector.data.shared.notice import (
    MAX_PEERS,
    NOTICE_BYTES,
    PENDING,
    SLOT_BYTES,
    Notice,
    NoticeSlot,
    NoticeSlots,
    next_serial,
)

__all__ = ["SharedBuffer", "PeerMap", "available", "copy_groups", "copy_runs", "process_alive",
           "streaming", "MapSide", "map_threshold", "MAX_PEERS", "NOTICE_BYTES", "PENDING",
           "SLOT_BYTES", "Notice", "NoticeSlot", "NoticeSlots", "next_serial"]
