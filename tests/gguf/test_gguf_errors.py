"""Files pdserve cannot serve are refused in one line that names the file and the reason."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize

from pdserve.config import ModelConfig
from pdserve.errors import CheckpointError
from pdserve.loader import load_model


def rewrite(src: str, dst: str, arch: str | None = None, retype: dict | None = None, kv: dict | None = None) -> str:
    """A copy of a GGUF file with another general.architecture, some tensors re-quantized and/or
    some metadata values replaced (kv: key -> value of the same type, or None to leave it out)."""
    r = GGUFReader(src)
    old_arch = r.fields["general.architecture"].contents()
    w = GGUFWriter(dst, arch or old_arch)
    kv = kv or {}
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or kv.get(name, ...) is None:
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
        w.add_key_value(name, kv.get(name, field.contents()), kind, sub_type=sub)
    for t in r.tensors:
        data, qtype = np.asarray(t.data), t.tensor_type
        if retype and t.name in retype:
            data, qtype = quantize(dequantize(data, qtype), retype[t.name]), retype[t.name]
        w.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def refusal(path: str, load: bool = False) -> str:
    with pytest.raises(CheckpointError) as e:
        cfg = ModelConfig.from_dir(path)
        if load:
            load_model(cfg, __import__("torch").float32, "cpu")
    msg = str(e.value)
    assert "\n" not in msg and path in msg
    return msg


def test_not_gguf(tmp_path):
    p = tmp_path / "model.gguf"
    p.write_bytes(b"PK\x03\x04 not a gguf file at all" * 10)
    assert "not a GGUF file" in refusal(str(p))


def test_truncated(make_gguf, tmp_path):
    _, gguf = make_gguf("qwen2", "f32")
    data = open(gguf, "rb").read()
    for cut in (10, 3000, len(data) // 2):
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(data[:cut])
        assert "truncated or corrupt" in refusal(str(p))


def test_unknown_architecture(make_gguf, tmp_path):
    _, gguf = make_gguf("qwen2", "f32")
    msg = refusal(rewrite(gguf, str(tmp_path / "mamba.gguf"), arch="mamba"))
    assert "architecture 'mamba' is not supported" in msg


def test_unsupported_tensor_type(make_gguf, tmp_path):
    _, gguf = make_gguf("qwen2", "f32")
    p = rewrite(gguf, str(tmp_path / "mxfp4.gguf"), retype={"blk.1.ffn_up.weight": T.MXFP4})
    msg = refusal(p, load=True)
    assert "'blk.1.ffn_up.weight' has type MXFP4" in msg


def test_two_gguf_files_in_a_directory(make_gguf, tmp_path):
    import shutil
    _, gguf = make_gguf("qwen2", "f32")
    for n in ("a.gguf", "b.gguf"):
        shutil.copy(gguf, tmp_path / n)
    assert "holds 2 GGUF files" in refusal(str(tmp_path))


def test_transformers_backends_refuse_a_gguf_model(make_gguf):
    from pdserve.baselines.baseline import Baseline
    _, gguf = make_gguf("qwen2", "f32")
    with pytest.raises(CheckpointError, match="served by the engine"):
        Baseline(gguf, device="cpu")


def test_phi3_long_rope_factors(make_tiny, tmp_path_factory):
    # Phi-3-*-128k / Phi-3.5: longrope's factors are tensors in the GGUF, which pdserve does not read
    from tests.gguf.test_gguf_model import phi4_style
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "long_factor": [1.5] * 8, "short_factor": [1.0] * 8,
            "original_max_position_embeddings": 256}
    _, gguf = phi4_style(make_tiny("phi3", rope_parameters=rope), tmp_path_factory)
    msg = refusal(gguf, load=True)
    assert "rope_factors_long.weight" in msg and "long-rope" in msg
