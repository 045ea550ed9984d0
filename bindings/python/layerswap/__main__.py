"""python -m layerswap: the same command as the `layerswap` console script (see layerswap.cli)."""

import sys

from layerswap.cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m layerswap"))
