"""`python -m parallax` is the `parallax` console script (pyproject.toml names `main` here).

`parallax.cli.main` does the work and returns the exit status; this wrapper owns the process:
- for `train`, SIGTERM/SIGINT are watched from before parallax's imports (a signal during
  start-up then gets its one line instead of a kill or a KeyboardInterrupt traceback), and the
  handlers stay until the process is gone (a late signal cannot turn a finished run's exit 0
  into a kill);
- after a failure it exits at once: a failed save can leave Orbax's (non-daemon) threads
  waiting, up to its 300 s barrier timeout, for a signal that never comes, and the interpreter's
  shutdown would join them. The one-line error has already been printed; nothing is left to write.
"""

import os
import sys
import threading
import traceback


def main() -> int:
    signals = None
    if "train" in sys.argv[1:3]:  # watch SIGTERM/SIGINT before the imports: start-up has its one line too
        from parallax.train.distributed import StopSignals

        signals = StopSignals(restore=False).__enter__()
    from parallax.train.distributed import error_prefix
    from parallax.cli import main as cli_main

    try:
        code = cli_main(signals=signals)
    except Exception:  # an unexpected error: its traceback, then the same prompt exit
        traceback.print_exc()
        code = 1
    if code:
        lingering = [t for t in threading.enumerate()
                     if t is not threading.main_thread() and not t.daemon and t.is_alive()]
        if lingering:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    elif signals is not None and signals.count and error_prefix() == "parallax":
        # Stopped by a signal, its checkpoint finalized: exit now. The interpreter's teardown
        # resets Python's signal handlers to the default, so a second SIGTERM arriving during it
        # would turn this exit 0 into a kill (the fault soak met it). One process only: several
        # leave through jax.distributed's shutdown, which their peers wait for.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return code


if __name__ == "__main__":
    sys.exit(main())
