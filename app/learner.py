"""`python -m fleetrl.app.learner ...` = `fleetrl learner ...` (for torchrun / the deepspeed launcher)."""

import sys

from fleetrl.app.cli import main

if __name__ == "__main__":
    sys.exit(main(["learner", *sys.argv[1:]]))
