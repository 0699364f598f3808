"""The decode node's wire messages round-trip through the connector's codec."""

from __future__ import annotations

import pytest

from statebridge.connector import messages as m
from statebridge.node import messages as nm

from tests.connector.test_messages import example


@pytest.mark.parametrize("cls", [getattr(nm, name) for name in nm.__all__], ids=lambda c: c.__name__)
def test_round_trip(cls):
    msg = example(cls)
    assert m.decode(m.encode(msg)) == msg
