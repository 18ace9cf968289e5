"""``python -m redknot.headmap``: see :mod:`redknot.headmap.cli`."""

import sys

from redknot.headmap.cli import main

sys.exit(main())
