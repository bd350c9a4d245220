"""Reading a checkpoint's config needs no model code (pdserve/config_fields.py): the tables agree,
and ModelConfig.from_dir imports no model class."""
import subprocess
import sys

from pdserve.config_fields import CONFIG_FIELDS
from pdserve.models import ARCHITECTURES


def test_every_architecture_has_a_config_reader_and_no_other_does():
    assert set(CONFIG_FIELDS) == set(ARCHITECTURES)


def test_reading_a_config_imports_no_model(tiny_llama):
    code = ("import sys; from pdserve.config import ModelConfig; "
            f"assert ModelConfig.from_dir({tiny_llama!r}).num_layers > 0; "
            "print(sorted(m for m in sys.modules if m.startswith('pdserve.models')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
