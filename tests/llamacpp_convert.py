"""Run llama.cpp's convert_hf_to_gguf.py (vendored in llama-cpp-python's sdist) on a folder:
tensors and hyperparameters only. The vocabulary is not written: the kernels' panels never
read it, and the test vocabularies are not in the converter's list of known pre-tokenizers.

Usage: python llamacpp_convert.py VENDOR_LLAMA_CPP MODEL_DIR [convert_hf_to_gguf.py options]
(tests/test_llamacpp_convert.py)."""

import runpy
import sys
from pathlib import Path


def main() -> None:
    src = Path(sys.argv[1])
    sys.path[:0] = [str(src), str(src / "gguf-py")]  # the converter's own gguf-py, as it runs itself
    sys.argv = [str(src / "convert_hf_to_gguf.py"), *sys.argv[2:]]
    import conversion  # the converter's registry of model classes

    get = conversion.get_model_class

    def without_vocab(*a, **k):
        """The model class the converter picks, its set_vocab a no-op."""
        cls = get(*a, **k)
        for c in cls.__mro__:
            if "set_vocab" in vars(c):
                c.set_vocab = lambda self: None
        return cls

    conversion.get_model_class = without_vocab
    runpy.run_path(str(src / "convert_hf_to_gguf.py"), run_name="__main__")


if __name__ == "__main__":
    main()
