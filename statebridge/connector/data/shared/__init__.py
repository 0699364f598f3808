"""Same-host shared-map reads (see :mod:`.buffer`)."""

from statebridge.connector.data.shared.buffer import (  # noqa: F401 -- re-exported
    PeerMap,
    SharedBuffer,
    available,
    copy_groups,
    copy_runs,
    process_alive,
    streaming,
)

__all__ = ["SharedBuffer", "PeerMap", "available", "copy_groups", "copy_runs", "process_alive",
           "streaming"]
