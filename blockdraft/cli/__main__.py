"""`python -m blockdraft.cli`, as the `blockdraft` command."""

import sys

from . import main

sys.exit(main())
