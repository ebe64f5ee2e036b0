"""`python -m fleetrl.learner ...` = `fleetrl learner ...` (for torchrun / the deepspeed launcher)."""

import sys

from fleetrl.common.cli import main

sys.exit(main(["learner", *sys.argv[1:]]))
