"""The bundled app's entry point (what PyInstaller freezes): the ``arbor`` command.

Started with no arguments (a double-click) it opens the window, like ``arbor`` from a pip
install; every subcommand (``generate``, ``chat``, ``serve``, ``models``...) works the same.
"""

import sys

from desktop.cli import main

if __name__ == "__main__":
    sys.exit(main())
