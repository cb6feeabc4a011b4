"""`python -m kvplane` is the `kvplane` command."""

from kvplane.cli import main

main()
