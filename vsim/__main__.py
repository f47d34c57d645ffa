"""`python -m vsim ...` is the same as the `vsim` command."""

from .cli import main

raise SystemExit(main())
