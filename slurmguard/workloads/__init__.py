"""Real training workloads for trying slurmguard on a cluster (DDP, FSDP, pipeline,
tensor parallel, 2-D), runnable as ``python -m slurmguard.workloads``."""
