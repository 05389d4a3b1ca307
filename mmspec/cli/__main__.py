"""`python -m mmspec.cli ...` = `mmspec ...`."""

import sys

from mmspec.cli import main


if __name__ == "__main__":
    sys.exit(main())
