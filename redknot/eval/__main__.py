"""``python -m redknot.eval``: see :mod:`redknot.eval.cli`."""

import sys

from redknot.eval.cli import main

sys.exit(main())
