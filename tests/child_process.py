"""Helpers for tests that start child processes."""
import signal


def sigint_default():
    """preexec_fn for a child that must see Ctrl-C: a test run started in the background by a
    non-interactive shell ignores SIGINT, and a child inherits that (Python then installs no
    KeyboardInterrupt handler, and the Ctrl-C tests fail for a reason that is not theirs)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
