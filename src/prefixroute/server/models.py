"""Learning what each instance serves: ``GET /v1/models`` on every instance, at start and
after every health round, into the router's :class:`~prefixroute.core.catalog.ModelCatalog`.

The I/O driver of the catalog. An instance answering a model list (vLLM's shape:
base models, and LoRA adapters with their ``parent``) is *listed*; one answering 404 or
405, or something that is not a model list, is *unlisted* (a SageMaker container may
serve no ``/v1/models``): the selector then leaves it every model no listed instance
serves. An instance that cannot be reached keeps what it last listed (it is taken out
of rotation by health checks, not forgotten).

After a round, inference components with ``Instances: DISCOVER`` follow the catalog
(:meth:`prefixroute.server.state.RouterState.models_changed`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import aiohttp
import orjson

from prefixroute.core.catalog import ServedModels, parse_model_list

if TYPE_CHECKING:
    from prefixroute.server.state import RouterState

__all__ = ["fetch_models", "refresh_models", "control_session", "UNLISTED", "MAX_MODELS_BYTES"]

log = logging.getLogger("prefixroute.server.models")

#: Largest ``/v1/models`` answer read, bytes (4,096 cards of a few hundred bytes).
MAX_MODELS_BYTES = 4 * 1024 * 1024
#: What :func:`fetch_models` returns for an instance that serves no model list.
UNLISTED = "unlisted"


def control_session() -> aiohttp.ClientSession:
    """A client session for the router's own calls to the instances (model lists, LoRA
    loads): its connections close after each call, so that none of them is left idle
    where inference requests are pooled, and a few calls a round cost nothing to set up."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True, limit=64),
                                 auto_decompress=False, trust_env=False)


async def fetch_models(session: aiohttp.ClientSession, instance_id: str,
                       timeout_s: float) -> ServedModels | str | None:
    """``GET instance_id/v1/models`` once: the :class:`ServedModels`, :data:`UNLISTED`
    (an answer that is not a model list: 404, 405, another shape), or ``None`` when the
    instance could not be asked (connection, timeout, 5xx: keep what is known)."""
    try:
        async with session.get(instance_id + "/v1/models", timeout=aiohttp.ClientTimeout(total=timeout_s),
                               headers={"Accept": "application/json", "Accept-Encoding": "identity"}) as resp:
            if resp.status >= 500:
                return None
            if resp.status != 200 or (resp.content_length or 0) > MAX_MODELS_BYTES:
                return UNLISTED
            body = await resp.content.read(MAX_MODELS_BYTES + 1)
        if len(body) > MAX_MODELS_BYTES:
            return UNLISTED
        return parse_model_list(orjson.loads(body))
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        log.debug("model list of %s: %s", instance_id, type(exc).__name__)
        return None
    except ValueError:  # (orjson's error is one) not JSON, or not a model list
        return UNLISTED


async def refresh_models(state: "RouterState", ids: list[str] | None = None) -> int:
    """Ask every configured instance (or those of ``ids``) for its models, concurrently,
    and record the answers; components that discover their copies follow. Returns how
    many instances' lists changed."""
    if state.session is None:  # (not serving)
        return 0
    ids = state.instance_ids() if ids is None else ids
    generations = [state.catalog.generation(i) for i in ids]
    async with control_session() as session:
        answers = await asyncio.gather(*(fetch_models(session, i, state.settings.health_check_timeout_s)
                                         for i in ids))
    changed = 0
    for instance_id, answer, generation in zip(ids, answers, generations):
        if answer is None:
            continue
        served = None if answer == UNLISTED else answer
        assert served is None or isinstance(served, ServedModels)
        if state.catalog.set(instance_id, served, generation):
            changed += 1
            if served is None:
                log.info("instance %s lists no models (its /v1/models is not a model list)", instance_id)
            else:
                log.info("instance %s serves %s", instance_id, ", ".join([*served.base, *served.adapters])[:500])
    if changed:
        state.models_changed()
    return changed
