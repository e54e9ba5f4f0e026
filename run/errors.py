"""The two ways a command stops on purpose: each is printed as one line (no traceback), exit 1.
And the commands' argument parser, whose own errors are one line too."""
import argparse


class UsageError(ValueError):
    """Bad user input (config, data, run directory): printed as one line; the exit code is 1."""


class RunError(RuntimeError):
    """A run that cannot go on (non-finite steps, a failed checkpoint save): one printed line."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse's, with its own errors (a flag unknown or misspelled, a value of the wrong type, a
    required one missing) one line as the commands' other errors, not a usage block above the
    line; the exit code stays argparse's 2. --help still prints the usage."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see --help)\n")


def out_of_memory(e: BaseException) -> str | None:
    """The first line of XLA's out-of-memory error (RESOURCE_EXHAUSTED, a JaxRuntimeError) or of
    numpy's MemoryError, for a command's one line; None for any other error."""
    if isinstance(e, MemoryError) or "RESOURCE_EXHAUSTED" in str(e):
        return (str(e) or type(e).__name__).splitlines()[0]
    return None
