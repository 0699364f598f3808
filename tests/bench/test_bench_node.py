"""statebridge.bench.node: a node command line with A/B switches off, for benchmark scripts."""

from __future__ import annotations

import pytest

from statebridge import cli
from statebridge.bench.node import main, switched_cli
from statebridge.errors import ConfigError

ARGS = ["prefill", "--model", "m", "--tp", "1", "--port", "1", "--max-prefill-tokens", "96"]


def test_the_node_config_has_the_switches_off_within_only():
    plain = cli._config
    with switched_cli(["batched_prefill"]):
        config = cli._config(cli.build_parser().parse_args(ARGS))
        assert config.batched_prefill is False and config.shared_map is True
        assert config.max_prefill_tokens == 96            # the node's own flags still apply
    assert cli._config is plain
    assert cli._config(cli.build_parser().parse_args(ARGS)).batched_prefill is True


def test_unknown_switches_are_refused(capsys):
    with pytest.raises(ConfigError, match="'fast_lane'"):
        with switched_cli(["fast_lane"]):
            pass
    with pytest.raises(SystemExit):
        main(["--off", "fast_lane", "--", *ARGS])
    assert "invalid choice: 'fast_lane'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--off", "batched_prefill"])
    assert "after --" in capsys.readouterr().err
