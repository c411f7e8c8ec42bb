"""The training CLI: ``python -m train --help``."""

from train.cli import main

main()
