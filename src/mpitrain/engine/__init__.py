"""The engine: one background thread per process that owns all communication of the job.

Requests come in from the front door (:mod:`mpitrain.collectives`); the thread negotiates
which are ready on every rank (:mod:`.negotiation`), fuses them (:mod:`.fusion`) and runs them
on the data plane (:mod:`mpitrain.ops`) through :mod:`.executor`.  The modules are imported one
by one where they are used; this package exports nothing itself.
"""
