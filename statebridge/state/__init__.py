"""What the state is and where its bytes live. No I/O, no UCX, no zmq."""

from statebridge.state.cache import StateCache
from statebridge.state.layout import LAYOUT_PRESETS, Layout, PageGeometry, RegionLayout
from statebridge.state.plan import Box, PairPlan, TransferPlan
from statebridge.state.sharding import SegmentShard, check_tp, local_channels, shard_segments
from statebridge.state.spec import LayerGroup, Segment, Sharding, StateSpec, StateTensorSpec

__all__ = [
    "StateSpec", "LayerGroup", "StateTensorSpec", "Segment", "Sharding",
    "SegmentShard", "shard_segments", "local_channels", "check_tp",
    "Layout", "PageGeometry", "RegionLayout", "LAYOUT_PRESETS",
    "Box", "PairPlan", "TransferPlan",
    "StateCache",
]
