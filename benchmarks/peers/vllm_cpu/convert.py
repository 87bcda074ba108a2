"""The embedded SmolLM2 GGUF -> an fp32 HF safetensors directory vLLM can load.

    python convert.py GGUF_DIR OUT_DIR

transformers loads the GGUF de-quantized but marks the model quantized and will not save it;
so its weights go into a plain model built from the same config, which saves.
"""

import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def main(source: str, out: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF_FILE)
    loaded = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF_FILE,
                                                  dtype=torch.float32)
    fields = {key: value for key, value in loaded.config.to_dict().items()
              if key not in ("quantization_config", "transformers_version")}
    config = AutoConfig.for_model(**fields)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=False)
    if config.tie_word_embeddings:
        model.tie_weights()
    model.generation_config = loaded.generation_config
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    print("wrote", out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
