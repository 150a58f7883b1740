"""`python -m shoal.cli ...`: the `shoal` command."""

import sys

from shoal.cli import main

sys.exit(main())
