"""`python -m mmspec.eval NAME ...` = `mmspec eval NAME ...`."""

import sys

from mmspec.eval import main


if __name__ == "__main__":
    sys.exit(main())
