"""``python -m statebridge.bench.hetero_tp``: the same as ``statebridge bench``."""

import sys

from statebridge.bench.hetero_tp.cli import main

sys.exit(main(sys.argv[1:]))
