"""Hub quantized checkpoints (AWQ, GPTQ, compressed-tensors) read into pdserve's group form.

config.py reads config.json's quantization_config (and refuses what cannot be served exactly);
quantized_tensors turns a checkpoint's per-linear tensors (qweight/qzeros/scales/g_idx,
weight_packed/weight_scale/..., possibly spread over shards) into (file, "<linear>.weight",
GroupQuantized or an exact dense tensor) for loader.load_model. docs/QUANTIZATION.md."""
import logging
from collections.abc import Iterable, Iterator

from pdserve.errors import CheckpointError
from pdserve.layers.quantized import GroupQuantized
from pdserve.quantization import awq, compressed, gptq
from pdserve.quantization.config import HubQuantization, check_requested, read_quantization

__all__ = ["HubQuantization", "check_requested", "read_quantization", "quantized_tensors"]
READERS = {"awq": awq, "gptq": gptq, "compressed-tensors": compressed}
logger = logging.getLogger("pdserve")


def quantized_tensors(cfg, tensors: Iterable[tuple]) -> Iterator[tuple]:
    """The checkpoint's tensors with each quantized linear's parts replaced by one
    (file, "<linear>.weight", GroupQuantized | dense tensor); other tensors pass through."""
    quant: HubQuantization = cfg.quantization
    if quant.method == "mxfp4":   # not linears: the MoE layer keeps the experts' blocks and scales as they are
        logger.info("%s: the linears dense, the experts MXFP4", quant.describe())
        yield from tensors
        return
    reader = READERS[quant.method]
    pending: dict[str, dict] = {}       # linear -> {part: tensor}, until all its parts have come
    files: dict[str, str] = {}
    dense: dict[str, int] = {}           # why a linear is served dense -> how many
    grouped = 0

    def emit(module: str):
        nonlocal grouped
        value = reader.convert(quant, module, pending.pop(module), files[module])
        if isinstance(value, GroupQuantized):
            grouped += 1
        else:
            why = "fp8 weights" if quant.scheme_for(module).kind == "fp8" else "act-order g_idx"
            dense[why] = dense.get(why, 0) + 1
        return files[module], f"{module}.weight", value

    for file, name, tensor in tensors:
        module, _, suffix = name.rpartition(".")
        if reader.role(suffix, tensor) is None:
            yield file, name, tensor
            continue
        need, optional = reader.parts(quant.scheme_for(module))
        if suffix not in need | optional:
            if suffix in compressed.DROPPED:   # a dynamic scheme's leftover activation scale
                continue
            raise CheckpointError(f"{file}: unexpected tensor {name!r} for {quant.describe()}")
        pending.setdefault(module, {})[suffix] = tensor
        if suffix in ("qweight", "weight_packed", "weight") or module not in files:
            files[module] = file
        if set(pending[module]) >= need | optional:
            yield emit(module)
    for module in list(pending):
        need, _ = reader.parts(quant.scheme_for(module))
        missing = sorted(need - set(pending[module]))
        if missing:
            raise CheckpointError(f"{files[module]}: missing tensor {module + '.' + missing[0]!r} "
                                  f"(a {quant.method} linear's part)")
        yield emit(module)
    logger.info("%s: %d linears in the group form%s", quant.describe(), grouped,
                "".join(f", {n} served dense ({why}: exact dequantized weights)" for why, n in dense.items()))

