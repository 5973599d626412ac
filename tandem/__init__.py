"""tandem: an LLM inference engine whose first-class feature is lossless speculative decoding."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput", "__version__"]

if TYPE_CHECKING:
    from tandem.engine.llm import LLM
    from tandem.outputs import CompletionOutput, RequestOutput
    from tandem.sampling_params import RequestOutputKind, SamplingParams


def __getattr__(name: str) -> Any:
    # Lazy: importing a submodule (scheduler, sampler) must not pull in the whole engine.
    if name == "LLM":
        from tandem.engine.llm import LLM

        return LLM
    if name in ("SamplingParams", "RequestOutputKind"):
        from tandem import sampling_params

        return getattr(sampling_params, name)
    if name in ("RequestOutput", "CompletionOutput"):
        from tandem import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'tandem' has no attribute {name!r}")
