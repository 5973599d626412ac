"""tandem: an LLM inference engine whose first-class feature is lossless speculative decoding."""

__version__ = "0.1.0"
