"""`python -m fovea ...` works like the `fovea` command."""

from fovea.cli import main

main()
