"""Per-request MTP union and the transport planes built from it (torch executors).

* ``mtp_union(topk)``: union / remap / counts of the MTP rows' top-k sets
  (``union.py``); ``mtp_union_reference`` is the torch reference and
  ``mtp_union_host`` the host build of the CUDA kernel's logic.
* ``build_planes(...)`` -> ``TransportPlanes``: per (source, destination) rank
  record lists for the packed exchange (``planes.py``).
"""

from sparkinfer.plan._native import mtp_union_host
from sparkinfer.plan.planes import TransportPlanes, build_planes
from sparkinfer.plan.union import mtp_union, mtp_union_reference, workspace_slots

__all__ = ["mtp_union", "mtp_union_reference", "mtp_union_host", "build_planes",
           "TransportPlanes", "workspace_slots"]
