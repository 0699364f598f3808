"""``python -m statebridge`` runs the same CLI as the ``statebridge`` console script."""

from statebridge.cli import main

raise SystemExit(main())
