"""Where a worker of ``serve --workers N`` puts its internal Unix socket (the aiohttp
app behind its fast data plane): named here, made by :mod:`.runner` in the worker,
removed by :mod:`.workers` in the supervisor when that worker exits."""

__all__ = ["worker_socket_prefix", "worker_socket_fallback_prefix"]


def worker_socket_prefix(index: int) -> str:
    """Name prefix of the directory of worker ``index``'s internal Unix socket (the
    aiohttp app behind its fast data plane), made in the supervisor's private metrics
    directory: removed with it, and by the supervisor when that worker exits."""
    return f"socket-{index}-"


def worker_socket_fallback_prefix(supervisor_pid: int, index: int) -> str:
    """The same, in ``$TMPDIR`` itself, when the metrics directory's path is too long for
    a Unix socket (short, to leave room for a long ``$TMPDIR``)."""
    return f"pr-{supervisor_pid}-{index}-"
