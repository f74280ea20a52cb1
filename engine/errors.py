"""The one exception type the CLI turns into a one-line message and a non-zero exit."""


class SpecPilotError(Exception):
    """A user-facing error: the message names what was wrong."""
