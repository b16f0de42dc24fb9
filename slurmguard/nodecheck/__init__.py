"""Slurm Prolog/Epilog logic (the scripts live in prolog_epilog/).

The prolog (`prolog.py`) runs fast local checks (GPU count and health through
NVML, NIC link state through sysfs) within a time budget and reports only by
exit code: Slurm drains a node whose prolog fails. It never calls scontrol and
never touches the network.

The epilog (`epilog.py`) archives the job's rank rings from the ring root into
the job trace store, writes a manifest, removes the ring directory and prunes
old archives.
"""
