"""The weights wing: where weights come from and the forms they run in.

- `sources`: the model source (explicit, FASTDLLM_MODEL, or the bundled default) and the bundled files.
- `checkpoint`: a checkpoint directory read into our CausalLM, dense or with its projections at 4-bit.
- `adapter`: the Fast-dLLM v2 adapter file (LoRA + mask token row) and the mask token itself.
- `gguf`: GGUF Q4_1 / Q8_0 blocks, read and cached; `q4_quantize`: any checkpoint's tensors to those blocks.
- `quant`: which weights the projections run with (WeightPolicy) and the model rewired onto 4-bit layers;
  `int4`: those layers; `kernels` + `csrc/`: our AVX-512 kernels; `packing`: the dense CPU decode layout.
"""
from .adapter import ADAPTER_FORMAT, MASK_TOKEN, AdapterError, apply_adapter, read_adapter_tensors, save_adapter
from .checkpoint import build_four_bit, build_model, default_dtype, four_bit_unfit, load_tokenizer, read_state_dict
from .sources import (BUNDLED_ADAPTER, BUNDLED_CACHE_NAME, BUNDLED_NAME, ModelSource, ModelSourceError,
                      bundled_adapter, bundled_base_dir, bundled_gguf_path, cache_dir, resolve_source, resolve_spec)

__all__ = [
    "ADAPTER_FORMAT", "MASK_TOKEN", "AdapterError", "apply_adapter", "read_adapter_tensors", "save_adapter",
    "build_four_bit", "build_model", "default_dtype", "four_bit_unfit", "load_tokenizer", "read_state_dict",
    "BUNDLED_ADAPTER", "BUNDLED_CACHE_NAME", "BUNDLED_NAME", "ModelSource", "ModelSourceError", "bundled_adapter",
    "bundled_base_dir", "bundled_gguf_path", "cache_dir", "resolve_source", "resolve_spec",
]
