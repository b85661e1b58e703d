"""The metadata contract: every operation declared once (``OPS``, metadata/api/ops.py), and
what a declaration is (metadata/api/contract.py)."""

from metadata.api.contract import Arg, Contract, Op, Route
from metadata.api.ops import OPS

__all__ = ["OPS", "Arg", "Contract", "Op", "Route"]
