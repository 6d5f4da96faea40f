"""`python -m benchmarks ...` (run from the repository root with the project's venv)."""

import sys

from benchmarks.cli import main

sys.exit(main())
