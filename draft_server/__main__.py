"""`python -m draft_server` is `draft-server`."""

import sys

from draft_server.cli import main

sys.exit(main())
