"""DDTree speculative decoding for vLLM: the algorithms and engine plumbing that the
patch series in ``patches/`` hooks into vLLM's V2 model runner."""

__version__ = "0.1.0"
