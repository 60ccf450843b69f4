"""Helpers and constants shared by several test modules (fixtures shared the same way live in conftest.py).
A test module imports from here, never from another test module."""
