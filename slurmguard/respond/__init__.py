"""Responses: tiers, escalation, safety limits and the audited Slurm actions."""
