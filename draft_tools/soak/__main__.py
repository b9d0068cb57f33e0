import sys

from draft_tools.soak.cli import main

sys.exit(main())
