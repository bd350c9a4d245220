"""Build a model from an HF checkpoint directory: config.json + safetensors (single or sharded)."""
import json
import os

import torch
from safetensors import safe_open
from tqdm import tqdm

from pdserve.checkpoint_files import checkpoint_file
from pdserve.config import ModelConfig
from pdserve.errors import CheckpointError
from pdserve.layers.rotary import RotaryEmbedding
from pdserve.models import ARCHITECTURES

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved


def weight_files(path: str) -> list[str]:
    index = checkpoint_file(path, "model.safetensors.index.json")
    single = checkpoint_file(path, "model.safetensors")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: unreadable shard index ({e})") from None
        if not all(isinstance(s, str) for s in shards):
            raise CheckpointError(f"{index}: weight_map values must be file names")
        files = [checkpoint_file(path, s) for s in shards]
        for f in files:
            if not os.path.isfile(f):
                raise CheckpointError(f"{f}: missing (listed in model.safetensors.index.json)")
        return files
    if os.path.isfile(single):
        return [single]
    raise CheckpointError(f"{single}: missing (need model.safetensors or model.safetensors.index.json; "
                          "pytorch_model.bin is not loaded, it can run code)")


def load_model(cfg: ModelConfig, dtype: torch.dtype, device: str) -> torch.nn.Module:
    # Build on the meta device (no random init of weights we overwrite), then materialise.
    with torch.device("meta"):
        model = ARCHITECTURES[cfg.architecture](cfg)
    model = model.to(dtype).to_empty(device=device)
    for m in model.modules():
        if isinstance(m, RotaryEmbedding):
            m.init_buffers(device)
    tied = cfg.tie_word_embeddings
    if tied:  # to_empty gives each module its own tensor: tie again
        model.lm_head.weight = model.get_submodule(embed_module_name(cfg)).weight
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = set()
    files = weight_files(cfg.path)
    with torch.no_grad():
        for file in files:
            with safe_open(file, framework="pt", device="cpu") as f:
                names = list(f.keys())
                for name in tqdm(names, desc=f"loading {os.path.basename(file)}", unit="tensor", leave=False,
                                 disable=len(names) < 50):
                    if name.endswith(IGNORED_SUFFIXES):
                        continue
                    target = name if name in params else "model." + name  # e.g. OPT's "decoder.*" keys
                    if target not in params:
                        raise CheckpointError(f"{file}: unexpected tensor {name!r} for {cfg.architecture}")
                    tensor = f.get_tensor(name)
                    if tuple(tensor.shape) != tuple(params[target].shape):
                        raise CheckpointError(f"{file}: tensor {name!r} has shape {tuple(tensor.shape)}, config.json "
                                              f"implies {tuple(params[target].shape)}")
                    params[target].copy_(tensor)
                    loaded.add(target)
    missing = [n for n in params if n not in loaded and not (tied and n == "lm_head.weight")]
    if missing:
        raise CheckpointError(f"{files[0]}: missing tensor {missing[0]!r}"
                              + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    return model.eval()


def embed_module_name(cfg: ModelConfig) -> str:
    return "model.decoder.embed_tokens" if cfg.architecture == "OPTForCausalLM" else "model.embed_tokens"
