"""``python -m gpumgr``: the ``gpumgr`` command."""

import sys

from gpumgr.cli import main

sys.exit(main())
