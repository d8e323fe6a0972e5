"""ckptverify: prove PyTorch distributed checkpoints intact, and resumption bitwise exact.

The public surface is small and imported lazily, so ``import ckptverify`` (and the command line's
``--help``) stays fast: torch is imported only by the parts that need it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["__version__", "verify_checkpoint"]

if TYPE_CHECKING:
    from ckptverify.verify import verify_checkpoint


def __getattr__(name: str) -> Any:
    if name == "verify_checkpoint":
        from ckptverify.verify import verify_checkpoint

        return verify_checkpoint
    raise AttributeError(f"module 'ckptverify' has no attribute {name!r}")
