"""Data shipped with pdserve: the training corpus and the bundled default model."""
import os

DATA_DIR = os.path.dirname(os.path.abspath(__file__))
CORPUS_DIR = os.path.join(DATA_DIR, "corpus")
# What `pdserve serve` runs with no model given (built by pdserve/tools/train_default.py).
DEFAULT_MODEL_DIR = os.path.join(DATA_DIR, "default-model")
