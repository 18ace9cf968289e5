"""``python -m redknot.profiler``: the same as ``redknot-profile``."""

import sys

from redknot.profiler.cli import main

sys.exit(main())
