class MlxformerError(Exception):
    """A user-facing error: bad input, missing file, unsupported model. Printed as one line by the CLI."""


class OptionError(MlxformerError, ValueError):
    """A bad option value. ``param`` names the option (the field of the dataclass it belongs to,
    e.g. ``"top_p"``) and ``message`` says what it must be; ``str(exc)`` is both."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param} {message}")
        self.param, self.message = param, message
