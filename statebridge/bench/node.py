"""A node command with A/B switches off, for benchmark scripts that start node processes:

    python -m statebridge.bench.node --off batched_prefill -- prefill --model DIR --tp 1 ...

runs ``statebridge prefill ...`` exactly as the CLI does, with its connector config's switches
``--off`` turned off (:func:`statebridge.bench.ab.switched_off`). The switches are no settings
(:mod:`statebridge.bench.ab`): no node flag or variable reaches them, only this harness.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Iterator, Sequence

from statebridge.bench.ab import SWITCHES, switched_off
from statebridge.errors import ConfigError

__all__ = ["main", "switched_cli"]


@contextlib.contextmanager
def switched_cli(off: Sequence[str]) -> Iterator[None]:
    """Within: the node CLI builds its connector config with the switches ``off`` off."""
    from statebridge import cli

    names = list(off)
    unknown = sorted(set(names) - set(SWITCHES))
    if unknown:
        raise ConfigError(f"unknown A/B switches {unknown}; the switches: {sorted(SWITCHES)}")
    plain = cli._config
    cli._config = lambda a: switched_off(plain(a), names)
    try:
        yield
    finally:
        cli._config = plain


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m statebridge.bench.node",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--off", action="append", default=[], choices=sorted(SWITCHES),
                   help="an A/B switch to turn off (repeatable)")
    p.add_argument("node", nargs=argparse.REMAINDER,
                   help="-- then the statebridge command line (prefill ... / decode ...)")
    args = p.parse_args(argv)
    node_argv = args.node[1:] if args.node[:1] == ["--"] else args.node
    if not node_argv:
        p.error("give the node's command line after --")
    from statebridge import cli

    with switched_cli(args.off):
        return cli.main(node_argv)


if __name__ == "__main__":
    sys.exit(main())
