"""`python -m torchspot ...`: the same as the `torchspot` command."""

import sys

from torchspot.cli import main

sys.exit(main())
