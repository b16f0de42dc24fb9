"""What-if analysis of training-job traces (paper 004, "Understanding stragglers
in large model training using what-if analysis").

Pipeline: trace.load_trace -> tensor.tensorize -> analysis.analyse (which builds
model.build_model and runs simulate.simulate) -> summary (render.to_text / to_json)
/ heatmap / timeline. ("Summary", not "report": the report is the admin's, slurmguard.report.)
adapter.trace_from_rank_ops converts slurmguard's own per-rank op tables.
"""
