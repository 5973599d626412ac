"""ModelConfig: which checkpoint, on which device, in which dtype; 'auto' values resolved once."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.config.validate import check_bool, check_choice, check_int, check_str
from tandem.errors import ConfigError

DTYPES = {
    "float32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16,
}
LOAD_FORMATS: tuple[str, ...] = ("auto", "safetensors", "gguf", "dummy")
# ``quantization`` (vLLM's names): a checkpoint format (detected from the files when unset; naming
# it checks the files are that format), on-the-fly weight-only quantization of a float checkpoint
# (int8 / int4), or tandem's "none": dequantize every weight to float at load (the reference path).
CHECKPOINT_QUANTIZATIONS: tuple[str, ...] = ("gguf", "gptq", "awq", "compressed-tensors")
ON_THE_FLY_QUANTIZATIONS: tuple[str, ...] = ("int8", "int4")
QUANTIZATIONS: tuple[str, ...] = (*CHECKPOINT_QUANTIZATIONS, *ON_THE_FLY_QUANTIZATIONS, "none")
# The LM head's weight dtype on CPU (docs/quantization.md, "LM head"): "auto" reads the model-dtype
# weight (float32 on CPU: the reference logits); "float16" keeps a half-size copy for the head's matmul
# (fp16 activations and logits: 3–4e-4 relative error, greedy picks can change at near-ties).
LM_HEAD_DTYPES: tuple[str, ...] = ("auto", "float16")
# vLLM spellings of the same formats through its GPU-only kernels.
QUANTIZATION_ALIASES: dict[str, str] = {"gptq_marlin": "gptq", "awq_marlin": "awq"}


@dataclass(frozen=True)
class ModelConfig:
    model: str
    tokenizer: str | None = None
    dtype: str | torch.dtype = "auto"
    device: str = "auto"
    seed: int = 0
    load_format: str = "auto"
    revision: str | None = None
    max_model_len: int | None = None  # None: the checkpoint's max_position_embeddings
    skip_tokenizer_init: bool = False  # vLLM's: no tokenizer; prompts are token ids, outputs carry no text
    quantization: str | None = field(default=None, metadata={
        "help": "weight quantization: " + " | ".join(QUANTIZATIONS) + " (default: detected from the checkpoint; "
                "int8/int4 quantize a float checkpoint's linears at load; none dequantizes everything; "
                "docs/quantization.md)", "short": "-q"})
    lm_head_dtype: str = field(default="auto", metadata={
        "help": "CPU only: the LM head's weight dtype, " + " | ".join(LM_HEAD_DTYPES) + " (default auto: the "
                "model dtype, float32 on CPU; float16: a half-size copy, faster batch-1 decode, logits rounded "
                "to fp16 so greedy picks can change at near-ties; docs/quantization.md)"})

    batch_invariant: bool = field(default=False, metadata={
        "help": "compute every row the same way whatever the step's other rows (CUDA: fixed matmul and "
                "attention tiles, no split-KV; CPU: one row at a time), so greedy output is bitwise the same "
                "with or without speculation at any batch size; slower (docs/architecture.md)"})

    def __post_init__(self) -> None:
        check_str("model", self.model)
        check_str("tokenizer", self.tokenizer, optional=True)
        check_dtype(self.dtype)
        check_str("device", self.device)
        check_int("seed", self.seed)
        check_choice("load_format", self.load_format, LOAD_FORMATS)
        check_str("revision", self.revision, optional=True)
        check_int("max_model_len", self.max_model_len, minimum=2, optional=True)
        check_bool("skip_tokenizer_init", self.skip_tokenizer_init)
        check_quantization("quantization", self.quantization)
        check_choice("lm_head_dtype", self.lm_head_dtype, LM_HEAD_DTYPES)
        check_bool("batch_invariant", self.batch_invariant)


def check_quantization(key: str, value: object) -> None:
    """None or a name of QUANTIZATIONS (or a vLLM alias); anything else is one ConfigError naming ``key``."""
    check_str(key, value, optional=True)
    if value is not None and value not in QUANTIZATIONS and value not in QUANTIZATION_ALIASES:
        raise ConfigError(key, f"quantization method {value!r} is not supported by tandem", allowed=QUANTIZATIONS)


def canonical_quantization(value: str | None) -> str | None:
    return QUANTIZATION_ALIASES.get(value, value) if value is not None else None


def check_dtype(dtype: object) -> None:
    """'auto', a name in DTYPES or one of their torch dtypes."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ConfigError("dtype", f"unsupported dtype {dtype}", ["auto", *DTYPES])
    elif not (isinstance(dtype, str) and (dtype == "auto" or dtype in DTYPES)):
        raise ConfigError("dtype", f"unknown dtype {dtype!r}", ["auto", *DTYPES])


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        return torch.device("cpu")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError("device", f"{device!r} requested but no CUDA device is available", ["auto", "cpu"])
        return torch.device(device)
    raise ConfigError("device", f"unknown device {device!r}", ["auto", "cpu", "cuda", "cuda:N"])


def resolve_dtype(dtype: str | torch.dtype, device: torch.device, checkpoint_dtype: str | None) -> torch.dtype:
    """'auto': float32 on CPU (exact reference numerics); on GPU the checkpoint's half type or bf16."""
    check_dtype(dtype)
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        if checkpoint_dtype in ("float16", "bfloat16"):
            return DTYPES[checkpoint_dtype]
        return torch.bfloat16
    return DTYPES[dtype]


def resolve_max_model_len(requested: int | None, checkpoint_max: int) -> int:
    if requested is None:
        return checkpoint_max
    check_int("max_model_len", requested, minimum=2)
    if requested > checkpoint_max:
        raise ConfigError(
            "max_model_len",
            f"{requested} exceeds the model's max_position_embeddings ({checkpoint_max})",
        )
    return requested
