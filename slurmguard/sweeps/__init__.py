"""Node sweeps (Guard 5): result schema, pass schedules, baselines, verdicts, job scripts.

Nothing here imports torch: the workloads that measure live in sweeps/ at the repository
root and run on the nodes; this package judges what they write.
"""
