"""The one error type for what a user must fix, `UserError`, and the few kinds code tells apart.

The CLI catches `UserError` (and the few non-project types `megatron_gspo.cli` lists), prints its
message as one line and exits with status 2; whoever raises it leaves every file already written
intact. A message names what to change: the dotted config key and its value, the file and row,
the run dir, the setting to lower. A subclass exists only where code or a reader needs the
distinction:

    UserError            bad input, or a state of the machine or run dir the command refuses
    +- ConfigError       a config key or value (also a ValueError, as config checks were)
    |  +- UnknownName    a name no registry holds (loss, reward): also a KeyError, for lookups
    +- DataError         a dataset file's content (names the file, row and field)
    +- RunDirError       the run dir belongs to another run, or another process writes it
    +- CheckpointError   a checkpoint that cannot be written or trusted (resume skips it)

Nothing here imports the rest of the package, so every room may raise these.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input, or a state the user must change: one line on stderr, exit status 2, nothing
    already written lost (`megatron_gspo.cli`)."""


class ConfigError(UserError, ValueError):
    """A bad config key or value: unknown key, wrong type, out of range, rules between keys, a
    setting this machine cannot run. The message starts with the dotted key."""


class UnknownName(ConfigError, KeyError):
    """A name no registry holds (a policy loss, a reward); the message lists the valid ones. A
    KeyError for registry lookups, a ConfigError for the CLI."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class DataError(UserError, ValueError):
    """Bad dataset content; the message names the file, row and field."""


class RunDirError(UserError):
    """This run may not write this run dir (another job or config, a second process, an
    unwritable path, changed inputs); one line naming the reason."""


class CheckpointError(UserError):
    """A checkpoint that cannot be written or trusted; one line naming the file. Resume skips
    such a step for the newest good one."""
