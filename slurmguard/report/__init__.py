"""Rendering of the admin report: terminal (rich), JSON (versioned schema), HTML (self-contained)."""
