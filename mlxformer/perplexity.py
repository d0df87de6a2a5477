"""placeholder"""


def register(subparsers) -> None:
    pass
