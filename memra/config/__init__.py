"""ModelConfig: one normalized, frozen description of a network, whatever file it came from.

Two front doors build it — `from_hf_config` (a `config.json` dict, including Qwen3.5's nested
`text_config` and `rope_parameters`) and `from_gguf_metadata` (the `{arch}.*` keys of a GGUF file) —
and nothing downstream ever looks at a raw config again. Both read every value through one typed field
reader (fields.py) that checks its type, finiteness and range before use.

    model.py      the frozen dataclasses (ModelConfig, RopeConfig, AttentionConfig, GdnConfig, MoeConfig)
    fields.py     the typed field reader and its bounds
    from_hf.py    config.json -> ModelConfig
    from_gguf.py  GGUF metadata -> ModelConfig
"""

from memra.config.from_gguf import GGUF_ARCHITECTURES, from_gguf_metadata
from memra.config.from_hf import from_hf_config
from memra.config.model import (
    ARCHITECTURES,
    FP32_WEIGHTS,
    HYBRID,
    AttentionConfig,
    GdnConfig,
    ModelConfig,
    MoeConfig,
    RopeConfig,
    rope_inv_freq_scaled,
)

__all__ = [
    "ARCHITECTURES", "FP32_WEIGHTS", "GGUF_ARCHITECTURES", "HYBRID", "AttentionConfig", "GdnConfig", "ModelConfig", "MoeConfig",
    "RopeConfig", "from_gguf_metadata", "from_hf_config", "rope_inv_freq_scaled",
]
