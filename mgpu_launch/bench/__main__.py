import sys

from mgpu_launch.bench import main

sys.exit(main())
