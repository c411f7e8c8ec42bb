"""The training CLI: ``python -m train --help``."""

import sys

import jaxamp

if not hasattr(jaxamp, "mixed_precision"):  # the registry's `jaxamp` is another project
    sys.exit(f"python -m train: the jaxamp at {jaxamp.__file__} is another project (the "
             "registry's `jaxamp`); install this library from the repository's checkout: "
             "pip install '.[train]' (its distribution is named jax-amp)")

from train.cli import main  # noqa: E402

main()
