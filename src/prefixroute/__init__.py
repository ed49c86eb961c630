"""prefixroute: a prefix-aware request router for LLM inference fleets."""

__version__ = "0.1.0"
