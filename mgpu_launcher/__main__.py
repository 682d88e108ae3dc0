"""``python -m mgpu_launcher`` is ``mgpu-train`` (mpirun starts each rank this way)."""

import sys

from mgpu_launcher.cli import main

sys.exit(main())
