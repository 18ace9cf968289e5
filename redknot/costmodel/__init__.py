"""Predicted cost of serving an extend with or without segment reuse (the reuse guarantee)."""
