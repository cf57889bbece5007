"""``python -m planner ...``: the same as ``pagedserve plan ...``."""

from planner.cli import main

raise SystemExit(main())
