"""placeholder"""


def register(subparsers) -> None:
    pass


def convert(*args, **kwargs):
    raise NotImplementedError
