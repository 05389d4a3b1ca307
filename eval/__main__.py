"""`python -m mmspec.eval NAME ...` = `mmspec eval NAME ...`."""

import sys

from mmspec.eval import main


sys.exit(main())
