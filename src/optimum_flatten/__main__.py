"""``python -m optimum_flatten`` (and ``torchrun ... -m optimum_flatten``, ``accelerate launch -m optimum_flatten``):
the command line without its console script, which launchers that start a module rather than a file need."""

import sys

from .cli.main import main

sys.exit(main())
