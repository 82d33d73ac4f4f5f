"""User-facing errors of the backend.

Every error a user can cause (a bad file, an unknown architecture, a prompt that does not fit)
is an ``ArborError`` whose message is one line that names the offending value. The CLI prints it
and exits with status 2; the desktop shows it in the chat. Anything else escaping the backend is a
bug in Arbor, not in the user's input.
"""


class ArborError(Exception):
    """Base class: a clear, one-line problem with the user's input or files."""


class ModelLoadError(ArborError):
    """A model folder or file is missing, truncated, corrupt or inconsistent."""


class UnknownArchitectureError(ModelLoadError):
    """config.json names a model_type that Arbor has no implementation for."""


class ContextLengthError(ArborError):
    """The prompt (plus requested output) does not fit the model's context window."""


class InvalidRequestError(ArborError):
    """A generation request is malformed (bad messages, bad sampling values, ...)."""
