"""A node command with A/B switches off, for benchmark scripts that start node processes:

    python -m statebridge.bench.node --off batched_prefill -- prefill --model DIR --tp 1 ...

runs ``statebridge prefill ...`` exactly as the CLI does, with its connector config's switches
``--off`` turned off (:func:`statebridge.bench.ab.switched_off`). The switches are no settings
(:mod:`statebridge.bench.ab`): no node flag or variable reaches them, only this harness.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from statebridge.bench.ab import SWITCHES, switched_off

__all__ = ["main"]


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

    plain = cli._config
    cli._config = lambda a: switched_off(plain(a), args.off)
    return cli.main(node_argv)


if __name__ == "__main__":
    sys.exit(main())
