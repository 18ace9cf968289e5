"""``python -m redknot``: the same as ``redknot`` (see :mod:`redknot.cli`)."""

import sys

from redknot.cli import main

sys.exit(main())
