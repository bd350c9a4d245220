"""Build a model from an HF checkpoint directory: config.json + safetensors (single or sharded)."""
import json
import logging
import os
import sys
from collections.abc import Iterable, Iterator

import torch
from safetensors import safe_open
from tqdm import tqdm

from pdserve.checkpoint_files import checkpoint_file
from pdserve.config import ModelConfig
from pdserve.errors import CheckpointError
from pdserve.layers.merged_linear import MergedLinear
from pdserve.layers.quantized import GroupQuantized, attach_shard, finish_quantized
from pdserve.layers.rotary import RotaryEmbedding
from pdserve.models import ARCHITECTURES
from pdserve.vlm_text import text_weight_name
from pdserve.quantization import quantized_tensors

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved
Tensorish = torch.Tensor | GroupQuantized


def show_progress() -> bool:
    """A progress bar only on a terminal: its carriage returns would fill a log file."""
    return sys.stderr is not None and sys.stderr.isatty()


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


def load_model(cfg: ModelConfig, dtype: torch.dtype, device: str,
               tensors: Iterable[tuple[str, str, Tensorish]] | None = None,
               dense_quantized: bool = True) -> torch.nn.Module:
    """The model with every parameter filled from `tensors` ((file, HF name, tensor) triples; by
    default the checkpoint's safetensors files). A GroupQuantized value is kept on its linear as
    `quant` (layers/quantized.py) and, with dense_quantized, also fills the linear's weight with the
    dequantized values; without (a backend that runs the codes: Backend.takes_codes) the weight is
    left on the meta device, never allocated, so that loading a 4-bit checkpoint does not need the
    memory of its dense form."""
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
    if cfg.text_of is not None:
        logging.getLogger("pdserve").info("%s: %s served as its text model %s (the vision tower is not loaded; "
                                          "image inputs are refused)", cfg.path, cfg.text_of, cfg.architecture)
    if tensors is None:
        tensors = gguf_tensors(cfg) if cfg.gguf_file else safetensors_tensors(cfg.path, served_name(cfg, model))
    if cfg.quantization is not None:   # AWQ / GPTQ / compressed-tensors parts -> one weight per linear
        tensors = quantized_tensors(cfg, tensors)
    fill(model, cfg, tensors, dense_quantized)
    if not dense_quantized:
        for m in model.modules():
            if getattr(m, "quant", None) is not None:   # the codes are the weight: free its allocation
                m.weight = torch.nn.Parameter(torch.empty_like(m.weight, device="meta"), requires_grad=False)
    return model.eval()


def gguf_tensors(cfg: ModelConfig) -> Iterator[tuple[str, str, Tensorish]]:
    """A GGUF model's tensors (pdserve/gguf/tensors.py): quantized linears as GroupQuantized."""
    from pdserve.gguf.reader import open_gguf
    from pdserve.gguf.tensors import gguf_tensors as tensors
    return tensors(open_gguf(cfg.gguf_file), cfg)


def served_name(cfg: ModelConfig, model: torch.nn.Module):
    """name in the checkpoint -> the name the model loads it by, or None for a tensor it does not use
    (a vision-language checkpoint's vision tower, DeepSeek's multi-token-prediction layers), so that
    such tensors are never read."""
    skips = getattr(model, "skips_tensor", lambda name: False)

    def served(name: str) -> str | None:
        name = text_weight_name(name) if cfg.text_of is not None else name
        return None if name is None or skips(name) else name
    return served


def safetensors_tensors(path: str, served=None) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(file, name, tensor) for every tensor of the checkpoint's safetensors files; served(name): the
    name to give a tensor, or None to skip it without reading it (served_name)."""
    for file in weight_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            names = list(f.keys())
            for name in tqdm(names, desc=f"loading {os.path.basename(file)}", unit="tensor", leave=False,
                             disable=len(names) < 50 or not show_progress()):
                as_name = served(name) if served is not None else name
                if as_name is not None:
                    yield file, as_name, f.get_tensor(name)


def fill(model: torch.nn.Module, cfg: ModelConfig, tensors: Iterable[tuple[str, str, Tensorish]],
         dense_quantized: bool = True) -> None:
    tied = cfg.tie_word_embeddings
    params = dict(model.named_parameters(remove_duplicate=False))
    # what must be filled, (parameter, shard) -> the name to report if it is missing: each shard of
    # a merged linear by its checkpoint name (shard None: a whole parameter)
    needed = {(n, None): n for n in params if not (tied and n == "lm_head.weight")}
    stacked = getattr(model, "stacked_params", {})
    for name, module in model.named_modules():
        if isinstance(module, MergedLinear):
            path, _, merged = name.rpartition(".")
            for p in ("weight", "bias") if module.bias is not None else ("weight",):
                del needed[(f"{name}.{p}", None)]
                needed.update({(f"{name}.{p}", i): f"{path}.{source}.{p}"
                               for source, (m, i) in stacked.items() if m == merged})
    # checkpoint tensors that each fill part of a parameter (an MoE model's per-expert tensors in its
    # stacked experts): name -> (parameter, index along its first dim or None, (first row, rows) or None
    # [, a function from the checkpoint's layout to the parameter's, e.g. gpt-oss's transposed experts])
    sliced = model.checkpoint_tensors() if hasattr(model, "checkpoint_tensors") else {}
    for name, (target, *_) in sliced.items():
        needed.pop((target, None), None)
        needed[(target, name)] = name
    # tensors the family does not use (DeepSeek's MTP), from sources that did not skip them unread (served_name)
    skips = getattr(model, "skips_tensor", lambda name: False)
    loaded, first_file = set(), None
    with torch.no_grad():
        for file, name, tensor in tensors:
            first_file = first_file or file
            if name.endswith(IGNORED_SUFFIXES) or skips(name):
                continue
            if name in sliced:
                target, index, rows, *convert = sliced[name]
                dest = params[target] if index is None else params[target][index]
                if convert and isinstance(tensor, torch.Tensor):
                    tensor = convert[0](tensor)
                load_slice(file, name, tensor, dest, rows)
                loaded.add((target, name))
                continue
            target, shard = stacked_target(model, name)
            if target not in params:
                target = "model." + target   # e.g. OPT's "decoder.*" keys
            if target not in params:
                if cfg.quantization is not None and name.endswith(".bias") and not tensor.any():
                    continue   # AutoGPTQ-made checkpoints carry zero biases for bias-free linears (vLLM skips them)
                raise CheckpointError(f"{file}: unexpected tensor {name!r} for {cfg.architecture}")
            dest = params[target]
            module = model.get_submodule(target.rpartition(".")[0])
            if shard is not None:   # its rows of the merged linear
                dest = dest.narrow(0, *module.shard_rows(shard))
            if tuple(tensor.shape) != tuple(dest.shape):
                raise CheckpointError(f"{file}: tensor {name!r} has shape {tuple(tensor.shape)}, config.json "
                                      f"implies {tuple(dest.shape)}")
            if isinstance(tensor, GroupQuantized):
                if not (isinstance(module, torch.nn.Linear) and target.endswith(".weight")):
                    raise CheckpointError(f"{file}: tensor {name!r} is quantized but is not a linear's weight")
                attach_shard(module, shard, tensor)
                if not dense_quantized:
                    loaded.add((target, shard))
                    continue
                tensor = tensor.dequantize()
            dest.copy_(tensor)
            loaded.add((target, shard))
    source = first_file or cfg.path
    missing = [shown for key, shown in needed.items() if key not in loaded]
    if missing:
        raise CheckpointError(f"{source}: missing tensor {missing[0]!r}"
                              + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    partial = finish_quantized(model)
    if partial:
        raise CheckpointError(f"{source}: {partial[0]} mixes quantized and full-precision shards")


def load_slice(file: str, name: str, tensor: Tensorish, dest: torch.Tensor, rows: tuple[int, int] | None) -> None:
    """A checkpoint tensor into its part of a parameter (rows of dest, or all of it)."""
    if isinstance(tensor, GroupQuantized):
        raise CheckpointError(f"{file}: tensor {name!r} is quantized; quantized experts are not supported")
    dest = dest if rows is None else dest.narrow(0, *rows)
    if tuple(tensor.shape) != tuple(dest.shape):
        raise CheckpointError(f"{file}: tensor {name!r} has shape {tuple(tensor.shape)}, config.json "
                              f"implies {tuple(dest.shape)}")
    dest.copy_(tensor)


def stacked_target(model: torch.nn.Module, name: str) -> tuple[str, int | None]:
    """A checkpoint tensor's parameter: `...self_attn.k_proj.weight` -> (`...self_attn.qkv_proj.weight`, 1)."""
    *path, module, param = name.split(".")
    merged = getattr(model, "stacked_params", {}).get(module)
    if merged is None:
        return name, None
    return ".".join([*path, merged[0], param]), merged[1]


def embed_module_name(cfg: ModelConfig) -> str:
    return ARCHITECTURES[cfg.architecture].embed_module
