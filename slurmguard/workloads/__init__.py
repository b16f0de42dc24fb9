"""Real training workloads for trying slurmguard on a cluster (DDP, FSDP, pipeline,
tensor parallel, 2-D), runnable as ``python -m slurmguard.workloads``.

Importing this package does not import torch; the shapes (shapes.py) and the
training loop (runtime.py) do.
"""

#: the parallel shapes, as named on the command line
SHAPES = ("ddp", "fsdp", "pp", "tp", "2d")
