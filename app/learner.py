"""`python -m fleetrl.app.learner ...` = `fleetrl learner ...` (for torchrun / the deepspeed launcher)."""

import sys

from fleetrl.app.cli import main

sys.exit(main(["learner", *sys.argv[1:]]))
