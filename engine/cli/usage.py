"""Command-line plumbing shared by `python -m engine demo` and `explain`: an argument
parser whose errors are one line (not argparse's usage block), and output that goes
quiet when the reader closes the pipe (`... | head`)."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, NoReturn


class UsageError(ValueError):
    """A bad command line: reported as one line, without a traceback, exit status 2."""


class OneLineParser(argparse.ArgumentParser):
    """argparse, with every error one line on stderr and exit status 2."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def quiet_on_closed_pipe(main: Callable[[], int]) -> int:
    """Run `main`; when stdout's reader has gone (`| head`), stop without a traceback or
    a 'Broken pipe' message, as a Unix filter does."""
    try:
        code = main()
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # Python flushes stdout again at exit; point it at /dev/null so that flush is silent.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
