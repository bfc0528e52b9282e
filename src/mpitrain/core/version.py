"""The package version, kept in one place for setup.py and the runtime."""

__version__ = "0.1.0"
