"""User-facing errors of the backend.

Every error a user can cause (a bad file, an unknown architecture, a prompt that does not fit)
is an ``ArborError`` whose message is one line that names the offending value. The CLI prints it
and exits with status 2; the desktop shows it in the chat. Anything else escaping the backend is a
bug in Arbor, not in the user's input.

Model code that reads a config or a checkpoint does not know which file it came from: it raises
``ConfigError`` / ``CheckpointError`` naming the field or tensor, and the loader adds the path.
"""


class ArborError(Exception):
    """Base class: a clear, one-line problem with the user's input or files."""

    def __init__(self, message: str = ""):
        # One line whatever a message quotes (library errors embedded in it may span several).
        super().__init__(" ".join(str(message).split()))


class ModelLoadError(ArborError):
    """A model folder or file is missing, truncated, corrupt or inconsistent."""


class UnknownArchitectureError(ModelLoadError):
    """config.json names a model_type that Arbor has no implementation for."""


class ConfigError(ModelLoadError):
    """A config value is missing, of the wrong type, out of range or inconsistent with another;
    the message names the key."""


class CheckpointError(ModelLoadError):
    """The weights do not fit the config: a missing, unexpected, misshapen or mistyped tensor;
    the message names the tensor."""


class ContextLengthError(ArborError):
    """The prompt (plus requested output) does not fit the model's context window."""


class InvalidRequestError(ArborError):
    """A generation request is malformed (bad messages, bad sampling values, ...); ``param``
    names the request field when one is to blame (the server reports it)."""

    def __init__(self, message: str = "", param: str | None = None):
        super().__init__(message)
        self.param = param
