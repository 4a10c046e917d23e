"""The one exception type expman raises for user-facing problems (bad params, files, tensors)."""

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import click

__all__ = ["ExpmanError", "user_errors"]


class ExpmanError(Exception):
    """A problem the user can fix; its message is one line naming the key, file or tensor."""


@contextmanager
def user_errors() -> Iterator[None]:
    """Turn an ExpmanError into one line on stderr and exit code 2 (no traceback)."""
    try:
        yield
    except ExpmanError as err:
        click.echo(f"error: {err}", err=True)
        sys.exit(2)
