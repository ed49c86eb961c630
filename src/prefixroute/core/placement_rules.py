"""The constants of CACHE_AWARE's placement rules, in blocks of the routing text
(``BlockSize`` characters, 64 by default), shared by the learned rule
(:mod:`prefixroute.core.cache_aware`) and the precise one
(:mod:`prefixroute.core.precise_policy`). Pure constants: no import.
"""

__all__ = ["ANCHOR_MIN_BLOCKS", "STICK_MIN_BLOCKS", "STICK_FRACTION", "TIE_BLOCKS", "REPLICATE_FRACTION",
           "BACKLOG_REPLICATE_FRACTION", "BACKLOG_QUORUM", "CONVERSATIONAL_SHARE", "CONTINUED_SHARE_WINDOW",
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
#: :data:`REPLICATE_FRACTION` for a backlogged fleet: every candidate with a request
#: waiting for its first token, by the router's count or the engine's (or
#: :data:`BACKLOG_QUORUM` of them, below). A copy's prefill then takes no idle capacity
#: but adds to a fleet that is already behind, and the copy evicts other prefixes from
#: caches that the running batches fill, so a queue moves a request off its home only
#: when longer by four requests' prefill. Simulated with the every-candidate test (the
#: ten workloads x 1, 4, 8 replicas x 5 seeds, docs/SIMULATOR.md): near-saturation P50
#: TTFT 792 -> 694 ms (1 replica), 1,179 -> 839 (4), 838 -> 740 (8) against 0.5; no
#: other workload changes by more than 0.4 points or 1 ms.
BACKLOG_REPLICATE_FRACTION = 4.0
#: A fleet also counts as backlogged (:data:`BACKLOG_REPLICATE_FRACTION`) when this
#: fraction of the candidates (rounded up: 3 of 4, 6 of 8; every one with 2 or 3) has
#: a request waiting, unless the traffic is conversational (:data:`CONVERSATIONAL_SHARE`).
#: Until 2026-12-06 every candidate had to: near saturation that fails whenever one
#: instance's queue is momentarily empty by the counts a router sees (its own requests
#: and the engines' last scraped ones: with several router replicas, often), and each
#: such moment replicated a document that then evicted others (simulated,
#: near-saturation with 4 replicas, seed 0, the simulator's per-request records read by
#: a throwaway script: 186 of 2,018 requests missed a document their home had held and
#: evicted, 52 with 1 replica). One or two instances with queues and the
#: others idle (a hot spot) are not a backlog, and a hot document still spreads.
BACKLOG_QUORUM = 0.75
#: :data:`BACKLOG_QUORUM` applies only while fewer than this share of the requests that
#: extend a prefix routed to their instance continue a request routed there (a
#: conversation's next turn, an agent's next step) rather than branch off it (a new
#: question about a document, a new conversation behind a system prompt); requests
#: that share nothing with their instance's view count for neither. Moving a new
#: conversation to an idle instance moves all its later turns, so conversational
#: traffic keeps the plain margin: with the quorum for every traffic a start burst of
#: new conversations behind one system prompt (each instance prefilling) stayed on the
#: prompt's home and one instance got none of them (simulated with a throwaway patch
#: that applied the quorum to every traffic, long-system-prompt, 1 replica, seed 0:
#: shares 31 / 35 / 34 / 0 %). The share is a moving average over
#: about :data:`CONTINUED_SHARE_WINDOW` such requests, starting at 1 (the plain margin
#: until the traffic shows what it is: a burst of up to about 88 new conversations
#: behind a shared prompt stays above the bar).
CONVERSATIONAL_SHARE = 0.5
#: See :data:`CONVERSATIONAL_SHARE` (the moving average's weight is 1 / this).
CONTINUED_SHARE_WINDOW = 128
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
