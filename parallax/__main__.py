"""`python -m parallax` is the `parallax` console script."""

import sys

from parallax.train import main

if __name__ == "__main__":
    sys.exit(main())
