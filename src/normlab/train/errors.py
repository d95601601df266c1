"""Checkpoint errors, in a module without torch so the command line can name them before importing it."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be (safely) loaded; the message names the file and why."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint whose pickle holds more than tensors and plain values: refused, never skipped."""
