"""Development tools, not shipped in the wheel: `python -m tools.make_model` (random-init HF
checkpoints with a trained tokenizer, for tests and benchmarks), `python -m tools.train_default`
(the bundled default model), `python -m tools.quantize_hub` (AWQ / GPTQ /
compressed-tensors checkpoints of a checkpoint, by round-to-nearest) and `python tools/corpus/generate.py` (their training corpus)."""
import os

CORPUS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")
