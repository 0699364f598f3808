"""A fault for tests of transfer verification (``--verify-transfers``): a decode rank whose
model asks for it flips one byte of what landed for a request just before it digests it --
as a transfer gone wrong would leave it (a bad copy, a stale or half-written page).

A :class:`~statebridge.connector.rank.RankModel` opts in by defining
``corrupt_landed(request_id) -> bool`` and calling :func:`install` in its constructor (in the
rank process). Nothing of the product imports this module.
"""

from __future__ import annotations

__all__ = ["install"]

_original = None


def install() -> None:
    """In this rank process: before a decode rank digests what landed for a request, flip the
    first byte of its page's first state region when its model's ``corrupt_landed(request_id)``
    says so. Idempotent; ranks whose model has no ``corrupt_landed`` are unaffected."""
    global _original
    from statebridge.connector.rank.worker import RankWorker

    if _original is not None:
        return
    _original = RankWorker._landed_digest

    def landed_digest(worker, p):
        ask = getattr(worker.model, "corrupt_landed", None)
        if ask is not None and ask(p.key.request_id):
            offset = min(r.offset for r in worker.geometry.regions)
            page = worker.cache.page_bytes(p.page)
            page[offset:offset + 1].bitwise_xor_(0xFF)
        return _original(worker, p)

    RankWorker._landed_digest = landed_digest
