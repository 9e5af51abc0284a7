"""``python -m fedsim`` is the ``fedsim`` command."""

import sys

from fedsim.cli import main

sys.exit(main())
