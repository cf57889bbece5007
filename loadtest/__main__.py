"""``python -m loadtest``: see loadtest/cli.py."""

from loadtest.cli import main

raise SystemExit(main())
