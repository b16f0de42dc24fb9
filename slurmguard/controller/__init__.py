"""The controller daemon: fleet model, decisions, actions (`slurmguard controller`, in controller/cli.py)."""
