"""DCP placement and the IndexShare pattern (public names; see sparkinfer/core/topology.py)."""

from sparkinfer.core.topology import GLM52_PATTERN, DcpLayout, IndexSharePattern

__all__ = ["DcpLayout", "IndexSharePattern", "GLM52_PATTERN"]
