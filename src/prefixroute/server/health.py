"""Active health checks: ``GET <instance><health_check_path>`` on every instance, periodically.

200 puts an instance (back) in rotation; anything else (other status, refused
connection, timeout) takes it out. Passive checks live in :mod:`.proxy`: a refused
connection takes the instance out at once, and the next successful probe brings it back.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from prefixroute.server.state import RouterState

__all__ = ["probe_instance", "check_all", "health_check_loop"]

log = logging.getLogger("prefixroute.server.health")


async def probe_instance(session: aiohttp.ClientSession, instance_id: str, path: str, timeout_s: float) -> bool:
    """True if ``GET instance_id + path`` answers 200 within ``timeout_s`` seconds."""
    try:
        async with session.get(instance_id + path, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            await resp.read()
            return resp.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return False


async def check_all(state: RouterState) -> dict[str, bool]:
    """Probe every configured instance once, concurrently, and update their health.

    Returns:
        ``{instance_url: healthy}``.
    """
    session = state.session
    if session is None:
        return {}
    s = state.settings
    ids = state.instance_ids()
    results = await asyncio.gather(
        *(probe_instance(session, i, s.health_check_path, s.health_check_timeout_s) for i in ids))
    for instance_id, ok in zip(ids, results):
        state.set_healthy(instance_id, ok)
    return dict(zip(ids, results))


async def health_check_loop(state: RouterState) -> None:
    """Run :func:`check_all` every ``settings.health_check_interval_s`` seconds, forever.

    The first round runs one interval after startup: instances start in rotation, so a
    router launched alongside its engines does not refuse traffic for a whole interval
    because they were still starting (a refused connection takes one out anyway).
    Cancel the task to stop it.
    """
    interval = state.settings.health_check_interval_s
    while True:
        await asyncio.sleep(interval)
        try:
            await check_all(state)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug here must not stop health checking
            log.exception("health check round failed")
