"""Where the aiohttp app behind the fast data plane listens: a fresh path for its
private Unix socket, in a new directory only this user can enter, short enough for a
Unix socket (``sun_path``), with a shorter fallback under the system's temporary
directory. :mod:`prefixroute.server.runner` makes it; a worker of ``serve --workers
N`` names its directory with :mod:`prefixroute.server.worker_sockets`.
"""

from __future__ import annotations

import os
import tempfile

__all__ = ["internal_socket_path"]

#: Longest path a Unix socket may have (``sun_path`` is 108 bytes on Linux, with its NUL).
_UNIX_PATH_MAX = 107


def internal_socket_path(parent: str | None = None, prefix: str = "prefixroute-",
                         fallback_prefix: str = "prefixroute-") -> str:
    """A fresh path for the aiohttp app's Unix socket, in a new directory only this user
    can enter: ``<parent>/<prefix>XXXXXXXX/app.sock`` (``parent`` ``None``: the system's
    temporary directory), or ``<system temporary directory>/<fallback_prefix>XXXXXXXX/
    app.sock`` if that path would be too long for a Unix socket (a long ``$TMPDIR``).

    Raises:
        OSError: even that path would be too long (nothing is created); the message
            says to shorten ``$TMPDIR``.
    """
    def longest(parent: str | None, prefix: str) -> str:
        return os.path.join(parent or tempfile.gettempdir(), prefix + "X" * 8, "app.sock")

    if parent is not None and len(os.fsencode(longest(parent, prefix))) > _UNIX_PATH_MAX:
        parent, prefix = None, fallback_prefix
    if len(os.fsencode(path := longest(parent, prefix))) > _UNIX_PATH_MAX:
        raise OSError(f"the internal Unix socket would be {path!r}, {len(os.fsencode(path))} bytes, over the "
                      f"{_UNIX_PATH_MAX} a Unix socket path may have: set TMPDIR to a shorter directory")
    directory = tempfile.mkdtemp(prefix=prefix, dir=parent)
    os.chmod(directory, 0o700)
    return os.path.join(directory, "app.sock")
