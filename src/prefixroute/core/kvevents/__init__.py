"""Engines' KV-cache events (vLLM's ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``).

Sans-I/O: bytes in, state and answers out; the sockets live in the drivers
(:mod:`prefixroute.engine.kv_publisher` publishes, :mod:`prefixroute.server.kv_subscriber`
subscribes).

* :mod:`.events`: the typed events and the medium (tier) names;
* :mod:`.codec`: msgpack encoding, in vLLM's positional-array and map forms, and a
  tolerant decoder for both;
* :mod:`.chain`: the router's own chained block keys, rebuilt from token ids;
* :mod:`.index`: what each instance holds, per medium, keyed by those keys;
* :mod:`.stream`: one instance's stream: sequence numbers, gaps, replay, restarts, mode;
* :mod:`.view`: :class:`~.view.PreciseCacheView`, the fleet's state and the question the
  routing policy asks it (leading tokens held per instance and medium).
"""
