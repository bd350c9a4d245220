"""Data shipped with pdserve: the bundled default model."""
import os

DATA_DIR = os.path.dirname(os.path.abspath(__file__))
# What `pdserve serve` runs with no model given (built by tools/train_default.py).
DEFAULT_MODEL_DIR = os.path.join(DATA_DIR, "default-model")
