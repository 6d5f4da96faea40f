import sys

from tiered.cli import main

sys.exit(main())
