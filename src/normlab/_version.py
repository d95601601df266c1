"""The package version, at the bottom of the package: any layer may name it without importing normlab's top."""

__version__ = "0.1.0"
