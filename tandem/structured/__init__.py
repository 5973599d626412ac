"""Structured output: grammar-constrained decoding through xgrammar (params, compiler cache, per-request
matcher, token bitmasks). See docs/architecture.md, "Structured output"."""
