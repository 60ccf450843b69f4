"""Readers and writers for the checkpoint formats meshlm's users hold."""
