"""What-if analysis of training-job traces (paper 004, "Understanding stragglers
in large model training using what-if analysis").

Pipeline: trace.load_trace -> tensor.tensorize -> analysis.analyse (which builds
model.build_model and runs simulate.simulate) -> report / heatmap / timeline.
adapter.trace_from_rank_ops converts slurmguard's own per-rank op tables.
"""
