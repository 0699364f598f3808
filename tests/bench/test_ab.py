"""The A/B switches: owned by the benchmark harness, no settings."""

from __future__ import annotations

import pytest

from statebridge.bench.ab import SWITCHES, switched_off, with_switches
from statebridge.config import AB_SWITCHES, ConnectorConfig
from statebridge.errors import ConfigError


def test_the_harness_documents_every_switch_of_the_config():
    assert set(SWITCHES) == set(AB_SWITCHES) == {"local_ranks", "shared_map", "batched_prefill"}
    c = ConnectorConfig()
    assert all(getattr(c, name) is True for name in AB_SWITCHES)        # on by default


def test_switches_are_set_by_name_and_checked():
    c = with_switches(ConnectorConfig(), shared_map=False)
    assert c.shared_map is False and c.local_ranks is True
    assert switched_off(ConnectorConfig(), ["local_ranks", "shared_map"]) == \
        ConnectorConfig(local_ranks=False, shared_map=False)
    with pytest.raises(ConfigError, match="unknown A/B switch 'shared_maps'"):
        with_switches(ConnectorConfig(), shared_maps=False)
    with pytest.raises(ConfigError, match="local_ranks must be True or False, got 0"):
        with_switches(ConnectorConfig(), local_ranks=0)
    with pytest.raises(ConfigError, match="shared_map must be a bool, got 'no'"):
        ConnectorConfig(shared_map="no")


@pytest.mark.parametrize("name", AB_SWITCHES)
def test_no_environment_variable_sets_a_switch(name):
    key = f"STATEBRIDGE_{name.upper()}"
    with pytest.raises(ConfigError, match=f"{key}='0': {name} is not a setting"):
        ConnectorConfig.from_env({key: "0"})
