"""`python -m vramkit`: the vramkit command line (see vramkit.cli)."""

from .cli import main

raise SystemExit(main())
