"""transformers' DeepSeek-V3, built as the DeepSeek tests compare against it."""

import torch
import transformers


def eager_deepseek(config, bias_std: float = 0.3):
    """transformers' ``DeepseekV3ForCausalLM`` of ``config`` in eval mode with eager attention, its router's
    correction biases drawn from N(0, ``bias_std``^2) (zero at init, which would hide their role in routing).
    Seed torch first for a fixed model."""
    config._attn_implementation = "eager"
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, bias_std)
    return model
