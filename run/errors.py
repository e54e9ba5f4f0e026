"""The two ways a command stops on purpose: each is printed as one line (no traceback), exit 1."""


class UsageError(ValueError):
    """Bad user input (config, data, run directory): printed as one line; the exit code is 1."""


class RunError(RuntimeError):
    """A run that cannot go on (non-finite steps, a failed checkpoint save): one printed line."""
