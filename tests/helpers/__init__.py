"""Helpers and constants shared by several test modules (fixtures shared the same way live in conftest.py).
A test module imports from here, never from another test module."""


def without_device_count(flags: str) -> str:
    """The suite's XLA flags (conftest.py's compile flags) without its 8 simulated devices: for a subprocess that
    sets its own device count, or runs on one device."""
    return " ".join(f for f in flags.split() if not f.startswith("--xla_force_host_platform_device_count"))
