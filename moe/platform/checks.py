"""Value checks shared by `moe` and `megatron_gspo` (plain Python: no torch, no megatron)."""


def is_int(value) -> bool:
    """A Python int that is not a bool (`isinstance(True, int)` is True)."""
    return isinstance(value, int) and not isinstance(value, bool)


class MissingDependency(ImportError):
    """An optional package a setting needs is not installed; the message names the setting and
    the install command (the CLI prints it as one line and exits with status 2)."""
