"""What the tests share: starting ranks (``multiproc``), planting faults (``faults``), building checkpoints
(``ckpt_factory``, ``dcp_encodings``). ``tests/`` is on ``sys.path`` (``tests/conftest.py``), so tests import
``from helpers import ...``; scripts may import these modules, never the reverse."""
