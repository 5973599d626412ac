"""Weight-only quantized linears for the CPU (issue #17; docs/quantization.md).

- ``weights.py``: :class:`QuantizedWeight`, the format-neutral form every format unpacks into;
- ``gguf_blocks.py`` / ``hf_formats.py``: GGUF blocks, GPTQ / AWQ / compressed-tensors → QuantizedWeight;
- ``cpu_q4.py`` / ``q4_linear.py``: tandem's own 4-bit CPU kernel (C, AVX-512 BF16; its AVX2 variant in
  ``cpu_q4_avx2.py``) and its module;
- ``int4pack.py`` / ``int8pack.py``: one kernel module each (torch's CPU weight-only matmuls);
- ``kernels.py``: picks the kernel for a weight; ``attach.py``: swaps them into a loaded model.
"""
