"""tandem: an LLM inference engine whose first-class feature is lossless speculative decoding."""

from tandem.engine.llm import LLM
from tandem.outputs import CompletionOutput, RequestOutput
from tandem.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]
