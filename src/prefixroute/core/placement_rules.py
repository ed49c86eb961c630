"""The constants of CACHE_AWARE's placement rules, in blocks of the routing text
(``BlockSize`` characters, 64 by default), shared by the learned rule
(:mod:`prefixroute.core.cache_aware`) and the precise one
(:mod:`prefixroute.core.precise_policy`). Pure constants: no import.
"""

__all__ = ["ANCHOR_MIN_BLOCKS", "STICK_MIN_BLOCKS", "STICK_FRACTION", "TIE_BLOCKS", "REPLICATE_FRACTION",
           "BACKLOG_REPLICATE_FRACTION",
           "BOUND_FACTOR", "BOUND_SLACK_REQUESTS", "BOUND_SLACK_BLOCKS", "SPREAD_FACTOR", "SPREAD_SLACK"]

#: A prefix is placed by the rendezvous order of its block past the longest match, but
#: never of a block before this one (1,024 characters with 64-character blocks): a
#: short header every request shares (an instruction line, a chat template's opening)
#: would otherwise send every new prefix to one instance on a router replica that has
#: not yet seen the header, and replicas would disagree.
ANCHOR_MIN_BLOCKS = 16
#: An instance is a prefix's *home* when it holds at least this many blocks (2: 128
#: characters) more of it than any other instance, and at least :data:`STICK_FRACTION`
#: of the request more, or when its match ends where a request routed to it ended (a
#: conversation's next turn, an agent's next step, however short the last one was).
STICK_MIN_BLOCKS = 2
#: See :data:`STICK_MIN_BLOCKS`.
STICK_FRACTION = 0.1
#: Costs within this many blocks (2,048 characters, about 512 tokens: 18 ms of prefill
#: on the reference engine) of the lowest are ties, broken by rendezvous: router
#: replicas whose load views differ by that much still agree.
TIE_BLOCKS = 32
#: A home keeps a request unless its cost exceeds the alternative's by more than the
#: tie band plus this fraction of the request's length: replicating a prefix on a
#: second instance costs its prefill there once and a second copy in the fleet's
#: caches for as long as it stays, so a queue only moves it when clearly longer.
REPLICATE_FRACTION = 0.5
#: :data:`REPLICATE_FRACTION` when every candidate has a request waiting for its first
#: token (a backlogged fleet: by the router's count or the engine's). A copy's prefill
#: then takes no idle capacity but adds to a fleet that is already behind, and the
#: copy evicts other prefixes from caches that the running batches fill, so a queue
#: moves a request off its home only when longer by four requests' prefill. Simulated
#: (the ten workloads x 1, 4, 8 replicas x 5 seeds, docs/SIMULATOR.md):
#: near-saturation P50 TTFT 792 -> 694 ms (1 replica), 1,179 -> 839 (4), 838 -> 740
#: (8) against 0.5; no other workload changes by more than 0.4 points or 1 ms.
BACKLOG_REPLICATE_FRACTION = 4.0
#: Bounded load (Mirrokni et al., "Consistent Hashing with Bounded Loads", SODA 2018):
#: a prefix is not placed on an instance whose queue cost exceeds this factor times the
#: mean over the instances below the threshold, plus :data:`BOUND_SLACK_REQUESTS`
#: requests and :data:`BOUND_SLACK_BLOCKS` blocks of prefill (16,384 characters: about
#: 140 ms of prefill on the reference engine). Loose on purpose: replicas see their own
#: requests and the engines' scraped load, and only a marked imbalance looks the same
#: to all of them.
BOUND_FACTOR = 2.0
#: See :data:`BOUND_FACTOR`.
BOUND_SLACK_REQUESTS = 4
#: See :data:`BOUND_FACTOR`.
BOUND_SLACK_BLOCKS = 256
#: A new branch off a shared prefix (not a continuation) leaves its home for the
#: branch's own rendezvous choice when the home has more than this factor times the
#: mean requests in flight over the instances below the threshold, plus
#: :data:`SPREAD_SLACK`: a long system prompt or a hot document is then replicated over
#: the fleet instead of keeping every new conversation on one instance.
SPREAD_FACTOR = 3.0
#: See :data:`SPREAD_FACTOR`.
SPREAD_SLACK = 2
