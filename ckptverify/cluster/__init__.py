"""Running one command across ranks: ``verify``, ``fingerprint`` and ``scan`` with their reads shared out.

Rank 0 runs the command as a single process does (commit marker, metadata, structure, manifest, archive
planning: small reads) and hands the byte-range work (CRC segments, block digests, whole-file digests,
whole checkpoints for ``scan``) to the ranks, balanced by bytes (:mod:`.split`). Each rank reads only the
units it was given (:mod:`.units`) and sends back small results (CRC values, digests, verdicts); rank 0
judges them exactly as one process does, so its one report holds the same findings, with the bytes each
rank read (``stats.ranks``).

The ranks meet through torch.distributed's rendezvous store (``env://``: torchrun's agent store, or one
rank 0 hosts under Slurm's ``srun`` and ``--readers``), and talk through it (:mod:`.group`): each rank beats
a heartbeat there, so a rank that dies or stops answering is named, with its host, within the timeout,
where a collective would only hang or fail without saying which peer it waited for.

Importing this package imports nothing heavy: :mod:`.env` decides, from the environment alone, whether a
command runs as one rank of many (the start-up cost of a plain ``verify`` stays as it was).
"""
