"""The prefill "model" of the transfer benchmark: synthetic state that costs (almost) nothing.

:class:`~statebridge.testing.models.SyntheticModel` draws and shards a request's whole global
state on every prefill (far longer than a transfer for Mamba2-2.7B): the benchmark would time
the stand-in model, not the transfer. :class:`PageOnceModel` fills a page with the full
synthetic state of the first request that uses it and afterwards only stamps the request's
8-byte seed into the page's first state bytes. Request ids starting with :data:`CHECK_PREFIX`
are always filled in full, so the decode side's checksums of those requests can be compared
with the oracle (byte-exactness).
A prefill rank's KV block pool is written once in full before any request: the timed requests
move whatever their blocks hold, and a block never written would be read from the kernel's
zero page (cache-hot, no memory traffic), where the NIXL yardstick's sources are written.

It reports ``chunked_prefill`` so that a prefill server started with its prefix cache on
(``statebridge bench --prefix-caching``) keeps checkpoints: a prompt may then come in several
chunks (steps end at the checkpoints), and a page or KV block is written once, when the
prompt's last chunk runs -- what a request moves does not depend on how it was cut.
"""

from __future__ import annotations

import numpy as np

from statebridge.connector.rank.model import PrefillChunk
from statebridge.testing.models import SyntheticModel

__all__ = ["PageOnceModel", "CHECK_PREFIX"]

CHECK_PREFIX = "chk-"


class PageOnceModel(SyntheticModel):
    """Fill a page on first use (and for check requests); otherwise stamp the request seed."""

    def __init__(self, setup, cache, kv=None) -> None:
        super().__init__(setup, cache, kv)
        self._filled: set[int] = set()
        self._stamp_at = min(r.offset for r in cache.geometry.regions)
        self._bytes = cache.buffer.numpy()       # the stamp: numpy slicing, not torch's
        if kv is not None and setup.role == "prefill":
            # Write the whole KV pool once, before any request: the timed requests move what
            # the blocks hold, and blocks never written would be read from the kernel's zero
            # page (cache-hot, no memory traffic) -- unlike the NIXL yardstick's sources.
            kv.buffer.fill_(0x5A)

    #: A prompt may come in chunks (the prefix cache's checkpoints need it); only the last
    #: chunk writes anything (:meth:`prefill_chunks`).
    chunked_prefill = True

    def prefill_chunks(self, chunks: "list[PrefillChunk]") -> "list[str | None]":
        """Each prompt's last chunk runs :meth:`prefill` for the whole prompt (its KV: all
        ``start + len(tokens)`` tokens); earlier chunks write nothing. Whole prompts (every
        chunk when nothing cuts them): exactly :meth:`prefill` per prompt, as before."""
        if all(c.last and not c.start for c in chunks):
            return super().prefill_chunks(chunks)
        out: list[str | None] = []
        for c in chunks:
            if not c.last:
                out.append(None)
                continue
            whole = PrefillChunk(c.request_id, c.page, (0,) * (c.start + len(c.tokens)),
                                 0, True, c.blocks)
            out += super().prefill_chunks([whole])
        return out

    def prefill(self, page: int, prompt: tuple[int, ...], request_id: str,
                blocks: tuple[int, ...] = ()) -> None:
        if page not in self._filled or request_id.startswith(CHECK_PREFIX):
            super().prefill(page, prompt, request_id, blocks)
            self._filled.add(page)
            return
        at = self.cache.page_offset(page) + self._stamp_at
        self._bytes[at:at + 8] = np.frombuffer(request_id.encode()[-8:].rjust(8, b"\0"),
                                               dtype=np.uint8)

    def prefill_kv(self, blocks: tuple[int, ...], tokens: int, request_id: str) -> None:
        """The synthetic KV for check requests only: the timed ones move whatever the blocks
        hold (drawing megabytes of random KV per request would time the stand-in)."""
        if request_id.startswith(CHECK_PREFIX):
            super().prefill_kv(blocks, tokens, request_id)
