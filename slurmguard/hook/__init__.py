"""Job instrumentation: the per-rank ring format (Python side), the
torch.distributed hook, and the `slurmguard ring` / `bench hook` commands.

The C side (SPANK plugin, NCCL hook, the format's one definition in
sg_ring.h) lives in spank_plugin/. Nothing here is imported by the package
at start-up; `ring` and `torchhook` use only the standard library so they
also run inside users' jobs.
"""
