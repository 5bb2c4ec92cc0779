"""`python -m vramkit`: the vramkit command line (see vramkit.commands)."""

from .commands.main import main

raise SystemExit(main())
