"""`python -m mmspec.cli ...` = `mmspec ...`."""

import sys

from mmspec.cli import main


sys.exit(main())
