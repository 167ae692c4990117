import sys

from . import main

if __name__ == "__main__":  # spawned worker processes (ablate --jobs) import the main module again
    sys.exit(main())
