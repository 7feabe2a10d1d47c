"""`python -m verispec.cli`: the command line."""

from .shell import main

main()
