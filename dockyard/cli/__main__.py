"""`python -m dockyard.cli`: the `dockyard` command."""

import sys

from dockyard.cli.main import main

sys.exit(main())
