"""RankHostPool: a launch that gave up on a host's answer does not take the next one's."""

from __future__ import annotations

import pytest

from statebridge.connector.rank import RankSetup
from statebridge.errors import ConfigError
from statebridge.testing.hosts import RankHostPool

from tests.connector._helpers import SPECS

pytestmark = [pytest.mark.ucx, pytest.mark.multiprocess]

SPEC = SPECS["mamba2-g1"]


def setup(model: str, node_id: str) -> RankSetup:
    return RankSetup(role="decode", coordinator="127.0.0.1:9", tp_rank=0, tp_size=1,
                     spec_json=SPEC.to_json(), layout="DLS", num_pages=2, node_id=node_id,
                     model=model)


def test_a_late_answer_is_dropped_not_taken_for_the_next_launch(caplog):
    with RankHostPool(1) as pool:
        launch = pool.launcher()
        pool.start_timeout = 0.3
        with pytest.raises(ConfigError, match=r"host 0 starting a rank: no answer in 0.3 s"):
            launch([setup("tests.testing._slow_model:SlowFailingModel", "slow")])
        # The host answers the slow start ("error") after ~1.5 s; the next launch must read
        # its own answer ("ok") and not that one.
        pool.start_timeout = 60.0
        handles = launch([setup("statebridge.testing.models:SyntheticModel", "fine")])
        assert len(handles) == 1 and handles[0].is_alive()
        counts = pool.ops()
        assert len(counts) == 1 and isinstance(counts[0], dict)
