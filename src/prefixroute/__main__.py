"""``python -m prefixroute`` runs the ``prefixroute`` command."""

import sys

from prefixroute.cli import main

sys.exit(main())
