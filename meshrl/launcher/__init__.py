"""Launchers turn a run config into running role servers and hand back their addresses."""
