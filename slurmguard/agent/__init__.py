"""The node agent (`slurmguard agent`, in agent/cli.py)."""
