"""Heterogeneous-TP transfer benchmark (same as ``statebridge bench``).

    python examples/benchmark_hetero_tp.py --preset mamba2-2.7b --pairs 2x4,4x2 \
        --layouts DLS,LDS,LSD --requests 32 --concurrency 4 \
        --json benchmarks/results/hetero-tp.json --plot benchmarks/results/hetero-tp.png
"""

import sys

from statebridge.bench.hetero_tp import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
