"""The ground floor: what every floor above stands on, and nothing of the engine or a framework.

The configuration (:mod:`.config`, every ``MPITRAIN_*`` variable), MPI's start and the
communicators, topology and device binding (:mod:`.runtime`, :mod:`.topology`,
:mod:`.binding`), process sets and element types (:mod:`.process_sets`, :mod:`.dtypes`),
errors and what happens when a rank fails or leaves (:mod:`.errors`, :mod:`.failure`,
:mod:`.departures`, :mod:`.finalize`, :mod:`.survivors`), and the small helpers they share.
These modules import MPI and numpy, and each other; torch only inside a function, as an
optional dependency.  ARCHITECTURE.md has the full list.
"""
