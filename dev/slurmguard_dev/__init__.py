"""slurmguard's development tools (distribution slurmguard-dev, in the checkout's dev/).

Not part of the product: a node or controller install never has it. It adds the
`slurmguard bench`, `devcluster` and `demo` commands through the `slurmguard.commands`
entry-point group, and holds what only development needs:

* `devcluster/`: a real multi-node Slurm cluster on one machine (cluster, guard: the
  controller and agents on it, scenario: the demo's degraded jobs, fault: CPU caps and
  other faults on a node, devreboot: the reboot program of its nodes, train: a DDP job);
* `bench/`: the benchmarks, one module per area of the product they measure;
* `demo.py`: the closed loop on the embedded default;
* `sweepfaults.py`: sweep fault injection (NodeFault, the `injected` record) and the
  launcher that runs the sweep workloads with it, wrapping their timers from outside.

It imports the product; the product never imports it (an import-linter contract).
"""
