"""Build a model from an HF checkpoint directory: config.json + safetensors (single or sharded)."""
import json
import os

import torch
from safetensors import safe_open
from tqdm import tqdm

from pdserve.checkpoint_files import checkpoint_file
from pdserve.config import ModelConfig
from pdserve.errors import CheckpointError
from pdserve.layers.merged_linear import MergedLinear
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
    # every parameter to fill: (name, shard) with shard None, or each shard of a merged linear
    needed = {(n, None) for n in params}
    for name, module in model.named_modules():
        if isinstance(module, MergedLinear):
            for p in ("weight", "bias") if module.bias is not None else ("weight",):
                needed.discard((f"{name}.{p}", None))
                needed |= {(f"{name}.{p}", i) for i in range(len(module.output_sizes))}
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
                    target, shard = stacked_target(model, name)
                    if target not in params:
                        target = "model." + target   # e.g. OPT's "decoder.*" keys
                    if target not in params:
                        raise CheckpointError(f"{file}: unexpected tensor {name!r} for {cfg.architecture}")
                    dest = params[target]
                    if shard is not None:   # its rows of the merged linear
                        dest = dest.narrow(0, *model.get_submodule(target.rpartition(".")[0]).shard_rows(shard))
                    tensor = f.get_tensor(name)
                    if tuple(tensor.shape) != tuple(dest.shape):
                        raise CheckpointError(f"{file}: tensor {name!r} has shape {tuple(tensor.shape)}, config.json "
                                              f"implies {tuple(dest.shape)}")
                    dest.copy_(tensor)
                    loaded.add((target, shard))
    missing = [n if s is None else n.replace(*stacked_source(model, n, s))
               for n, s in sorted(needed - loaded, key=str) if not (tied and n == "lm_head.weight")]
    if missing:
        raise CheckpointError(f"{files[0]}: missing tensor {missing[0]!r}"
                              + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    return model.eval()


def stacked_target(model: torch.nn.Module, name: str) -> tuple[str, int | None]:
    """A checkpoint tensor's parameter: `...self_attn.k_proj.weight` -> (`...self_attn.qkv_proj.weight`, 1)."""
    *path, module, param = name.split(".")
    merged = getattr(model, "stacked_params", {}).get(module)
    if merged is None:
        return name, None
    return ".".join([*path, merged[0], param]), merged[1]


def stacked_source(model: torch.nn.Module, name: str, shard: int) -> tuple[str, str]:
    """The (merged, checkpoint) module names to turn a missing shard back into its checkpoint name."""
    module = name.split(".")[-2]
    source = next(k for k, (m, i) in model.stacked_params.items() if m == module and i == shard)
    return f".{module}.", f".{source}."


def embed_module_name(cfg: ModelConfig) -> str:
    return "model.decoder.embed_tokens" if cfg.architecture == "OPTForCausalLM" else "model.embed_tokens"
