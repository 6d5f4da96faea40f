"""`python -m tiered`: the `tiered` command line."""

import sys

from tiered.cli import main

sys.exit(main())
