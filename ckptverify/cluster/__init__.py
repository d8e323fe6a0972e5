"""Running ``verify``, ``fingerprint`` and ``scan`` across ranks, with their reads shared out.

Rank 0 runs the command as one process does (small reads) and hands byte-range work to the ranks, balanced by
bytes (:mod:`.split`, :mod:`.units`); it judges their small results exactly as one process would, so the report
is the same, plus ``stats.ranks``. Ranks meet and talk through torch.distributed's rendezvous store
(:mod:`.group`) with heartbeats, so a dead or silent rank is named with its host within the timeout (a collective
would just hang). Importing this package is cheap: :mod:`.env` decides from the environment alone.
"""
