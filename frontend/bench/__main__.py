"""`python -m frontend.bench SUBCOMMAND ...` is `xlaserve bench SUBCOMMAND ...`."""

import sys

from frontend.bench import main

sys.exit(main())
