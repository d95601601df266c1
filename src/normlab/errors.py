"""The errors a user can cause, in one module without dependencies.

Each is raised with a message that says what was wrong and what is valid; the command line prints it
as one line and exits with status 2 (`normlab.cli.USER_ERRORS`). They live here, at the bottom of
the package, so that any layer can raise them and the CLI can name them before importing torch.
"""


class LayoutError(ValueError):
    """A layout (object or string form) that cannot be built; the message names the fix."""


class ConfigError(ValueError):
    """An invalid setting or combination of settings; the message says what is wrong and what is valid."""


class DataError(ValueError):
    """Data that cannot be used; the message says what is wrong with which file."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be (safely) loaded; the message names the file and why."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint whose pickle holds more than tensors and plain values: refused, never skipped."""


class ForeignFolderError(ValueError):
    """An output folder holds files normlab did not write; nothing there is overwritten."""


class OutputError(ValueError):
    """An output that could not be written (a full disk, a read-only file system); nothing half-written is left."""


# torch's advice on a pickle its weights-only loader refused ("Re-running `torch.load` with `weights_only` set to
# `False` will likely succeed, but it can result in arbitrary code execution"): exactly what must not be done
UNSAFE_ADVICE = ("weights_only", "arbitrary code execution", "trusted source")


def without_unsafe_advice(text: str) -> str:
    """``text`` without any sentence that advises loading a file unsafely: nothing normlab prints passes it on."""
    if not any(a in text for a in UNSAFE_ADVICE):
        return text
    return ". ".join(s for s in text.split(". ") if not any(a in s for a in UNSAFE_ADVICE))


USER_ERRORS = (LayoutError, ConfigError, DataError, CheckpointError, ForeignFolderError, OutputError)
