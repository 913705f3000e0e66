"""argparse types the scripts share."""

import argparse


def at_least(minimum: int):
    """An argparse type: an integer of at least `minimum` (argparse reports another naming the flag)."""
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value
    parse.__name__ = f"integer >= {minimum}"  # (how argparse names the type in "invalid ... value")
    return parse
