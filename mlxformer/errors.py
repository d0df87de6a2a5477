class MlxformerError(Exception):
    """A user-facing error: bad input, missing file, unsupported model. Printed as one line by the CLI."""
