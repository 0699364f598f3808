"""The real-process transfer matrices, in process: what each decode rank must receive, checked
against the byte oracles without starting a rank.

A prefill rank's page is filled as :class:`~statebridge.testing.models.SyntheticModel` fills it
(:func:`~statebridge.testing.synthetic.fill_page`), the groups' plan is executed with plain
copies (:func:`tests.state._oracle.copy_runs`; staged pairs through a staging buffer), and each
decode rank's page checksum must equal the oracle's (:func:`._helpers.expected_checksum`, the
checksum the real-process tests compare). The KV blocks go through
:func:`tests.state.test_kv.check_request` (the independent KV oracle of ``_kv_oracle``).
"""

from __future__ import annotations

import numpy as np

from statebridge.state.cache import StateCache, page_checksum
from statebridge.state.kv import BlockGeometry, KVPlan, blocks_for
from statebridge.state.layout import PageGeometry
from statebridge.state.plan import TransferPlan
from statebridge.state.spec import StateSpec
from statebridge.testing.synthetic import fill_page, global_state, request_seed

from tests.state.test_plan import run_pairs

from ._helpers import expected_checksum


def check_pages(spec: StateSpec, src_tp: int, dst_tp: int, src_layout: str, dst_layout: str,
                requests: int = 3) -> TransferPlan:
    """Every decode rank's page byte-exact for ``requests`` request ids, every state byte
    written once; the plan (for the caller's zero-copy/staging checks)."""
    plan = TransferPlan(PageGeometry(spec, src_tp, src_layout),
                        PageGeometry(spec, dst_tp, dst_layout))
    for rid in (f"req-{i}-{src_tp}x{dst_tp}" for i in range(requests)):
        state = global_state(spec, request_seed(rid))
        src_pages = []
        for s in range(src_tp):
            cache = StateCache(plan.src, 1)
            fill_page(cache, 0, state, s)
            src_pages.append(cache.buffer.numpy())
        dst_pages, writes = run_pairs(plan, src_pages)
        for d in range(dst_tp):
            assert page_checksum(plan.dst, dst_pages[d]) == expected_checksum(plan.dst, rid, d), \
                f"{rid}: decode rank {d} page differs from the oracle"
            written = np.concatenate([writes[d][r.offset:r.end] for r in plan.dst.regions])
            assert (written == 1).all(), f"{rid}: decode rank {d}: a state byte not written once"
    return plan


def check_kv(spec: StateSpec, src_tp: int, dst_tp: int, src_kv: str, dst_kv: str) -> None:
    """The KV blocks of requests around block boundaries, scattered and consecutive block
    tables, byte-exact at every decode rank (whole blocks, every byte once, each head from
    its lowest source rank)."""
    from tests.state import test_kv as t

    plan = KVPlan(BlockGeometry(spec.kv, src_tp, src_kv, t.BLOCK_SIZE, t.SRC_BLOCKS),
                  BlockGeometry(spec.kv, dst_tp, dst_kv, t.BLOCK_SIZE, t.DST_BLOCKS))
    rng = np.random.default_rng(src_tp * 100 + dst_tp)
    for tokens in t.TOKENS:
        for what, src_table, dst_table in t.tables(blocks_for(tokens, t.BLOCK_SIZE), rng):
            t.check_request(plan, spec.kv, tokens, src_table, dst_table, what)
