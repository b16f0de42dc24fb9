"""A real multi-node Slurm cluster on one machine, from Debian's packages.

One private munged, one slurmctld and N `slurmd -N nodeK`, each with its own
port, spool and log, all under one state directory. Used by the test suite,
the demo and the benchmarks.
"""

from slurmguard_dev.devcluster.cluster import ClusterSpec, DevCluster, DevClusterError, MissingSoftware

__all__ = ["ClusterSpec", "DevCluster", "DevClusterError", "MissingSoftware"]
