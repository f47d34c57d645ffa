"""`python -m vsim ...` is the same as the `vsim` command."""

from .cli import run_main

run_main()
