"""`python -m xavier_cli`: the `xavier` command without its installed script."""

import sys

from xavier_cli.main import main

sys.exit(main())
