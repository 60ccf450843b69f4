"""`python -m meshlm` and the `meshlm` program (`main`, the console script's entry point).

Ctrl-C is handled from the first line: while Python still imports the command line's modules (NumPy,
JAX: seconds on a slow machine) it ends the process as a command's Ctrl-C does, with status 130 and one
line, not a KeyboardInterrupt traceback from inside an import."""

import os
import signal
import sys


def _stopped_while_starting(signum: int, _: object) -> None:
    print(f"meshlm: stopped by signal {signum} (Ctrl-C) while starting", file=sys.stderr, flush=True)
    os._exit(128 + signum)


def main() -> None:
    signal.signal(signal.SIGINT, _stopped_while_starting)
    from meshlm import cli

    signal.signal(signal.SIGINT, signal.default_int_handler)  # the commands handle Ctrl-C from here on
    cli.run()


if __name__ == "__main__":
    main()
