"""``python -m redknot.cli``: the same as ``redknot``."""

import sys

from redknot.cli import main

sys.exit(main())
