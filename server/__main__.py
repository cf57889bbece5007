"""``python -m server [options]`` is ``pagedserve serve [options]``."""

import sys

from server.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
