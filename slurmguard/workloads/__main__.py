"""python -m slurmguard.workloads SHAPE ...: see slurmguard.workloads.cli."""

import sys

from slurmguard.workloads.cli import main

sys.exit(main())
