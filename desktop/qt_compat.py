"""Guard against a PySide6 reference-count bug on Python < 3.12 (imported for its effect).

PySide6 6.12.0 (``cp310-abi3`` wheels) drops one reference to ``True`` on every signal emission
and one to ``None`` whenever a Python override called from C++ returns it (``paintEvent``, an
item model's ``data`` for a role it does not handle, ``setVisible``...). On Python 3.12+ these
singletons are immortal and nothing happens; on 3.10/3.11 their counts fall with every repaint and
signal until the interpreter aborts with "Fatal Python error: bool_dealloc" or "none_dealloc" -
minutes into a streaming session.

``install()`` checks for the bug at run time (a few signal emissions must not change ``True``'s
count) and, only if it is present, gives ``None``, ``True`` and ``False`` a reference count so
large that it can never reach zero - what Python 3.12 does for them natively. Nothing else is
touched, and on a fixed PySide6 or a newer Python it does nothing.
"""

from __future__ import annotations

import ctypes
import sys

_HEADROOM = 1 << 40  # ~10^12 lost references: decades of repaints
_installed = False


def bug_present() -> bool:
    """True when emitting a signal loses references to ``True`` (the PySide6 bug)."""
    from PySide6.QtCore import QObject, Signal

    class _Probe(QObject):
        ping = Signal()

    probe = _Probe()
    before = sys.getrefcount(True)
    for _ in range(64):
        probe.ping.emit()
    return before - sys.getrefcount(True) >= 32


def install() -> bool:
    """Apply the guard if needed (idempotent); returns whether it is active."""
    global _installed
    if _installed:
        return True
    if sys.version_info >= (3, 12) or sys.implementation.name != "cpython" or not bug_present():
        return False
    for singleton in (None, True, False):
        # ob_refcnt is the first field of every CPython object header.
        ctypes.c_ssize_t.from_address(id(singleton)).value += _HEADROOM
    _installed = True
    return True


install()
