"""slurmguard: keep the nodes of a Slurm GPU cluster fast, not just alive."""

__version__ = "0.1.0"

#: Every reason or comment slurmguard writes into Slurm starts with this prefix.
#: It is part of the on-cluster contract: never change it between versions, or
#: old drains stop being recognised as ours.
REASON_PREFIX = "slurmguard:"
