"""Triage: the ladder that remediates failed nodes, and the admin view of the fleet (report*)."""
