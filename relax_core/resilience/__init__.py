"""Surviving failures: role health checks and restarts, whole-run checkpoints."""
