"""argparse types that check a flag's value when the command line is read, so that a bad one
stops with argparse's one line naming the flag (`argument --json: ...`) before a plan is
computed or a benchmark's runs have been spent, not as a traceback after them."""
from __future__ import annotations

import argparse
import os


def _output_file(text: str, parents_made: bool) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path: name the file to write")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a directory: name the file to write in it")
    parent = os.path.dirname(os.path.abspath(text))
    if parents_made:  # the command makes the missing folders: what exists must be folders
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        what = "is not a directory" if os.path.exists(parent) else "does not exist"
        raise argparse.ArgumentTypeError(f"cannot write {text}: its folder {parent} {what}")
    return text


def output_file(text: str) -> str:
    """A file to write whose folder exists; not a directory."""
    return _output_file(text, parents_made=False)


def output_file_in_new_folders(text: str) -> str:
    """A file to write, its missing folders made by the command; not a directory, and not
    under a file."""
    return _output_file(text, parents_made=True)


def seed(text: str) -> int:
    """A 32-bit seed, as numpy takes it: an integer in [0, 2**32 - 1]."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer seed, got {text!r}") from None
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"must be in [0, 2**32 - 1] (a 32-bit seed), got {value}")
    return value
