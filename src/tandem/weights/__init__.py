"""Layer 1: how weights travel from the trainer to engines.

For now one seam: ``WeightUpdate`` (a version, its content hash and the full tensors in the engine's dtype),
made by ``make_update`` on the trainer side and checked by ``verify_update`` on the engine side. The
delta-weights work replaces what travels inside the update, not the seam.
"""

from tandem.weights.seam import WeightUpdate, make_update, tensors_hash, verify_update

__all__ = ["WeightUpdate", "make_update", "tensors_hash", "verify_update"]
