"""Which Hub quantization a checkpoint carries, read from config.json's `quantization_config` as
vLLM reads it (`quant_method`), and refused in one line where pdserve cannot serve it exactly.

Served: AWQ (GEMM packing, zero points), GPTQ (4/8-bit, any group size, sym or not, act-order,
checkpoint format v1 or v2), compressed-tensors (pack-quantized / int-quantized / naive-quantized
integer weights with no activation quantization, float-quantized FP8 weights served dense), MXFP4
(gpt-oss's experts, kept as blocks and scales: quantization/mxfp4.py).
Everything is checked here, before a weight is read."""
import json
import re
from dataclasses import dataclass, field

from pdserve.errors import CheckpointError, ConfigError

SERVED = ("awq", "gptq", "compressed-tensors", "mxfp4")
# methods transformers / vLLM know that pdserve does not read, with the reason given to the user
NOT_SERVED = {
    "bitsandbytes": "its NF4/FP4/LLM.int8 blocks are not in pdserve's group form",
    "hqq": "its per-group scale/zero tensors and packing are not read by pdserve",
    "exl2": "its variable bit widths per column are not in pdserve's group form",
    "exllamav2": "its variable bit widths per column are not in pdserve's group form",
    "marlin": "Marlin's GPU tile layout is not read (use the GPTQ/AWQ checkpoint it was made from)",
    "gptq_marlin": "Marlin's GPU tile layout is not read (use the GPTQ checkpoint it was made from)",
    "awq_marlin": "Marlin's GPU tile layout is not read (use the AWQ checkpoint it was made from)",
    "fp8": "block-FP8 checkpoints (quant_method fp8) are not read; compressed-tensors FP8 is",
    "eetq": "int8 kernels of its own layout", "aqlm": "additive codebooks", "quanto": "optimum-quanto's layout",
    "gguf": "serve the .gguf file itself",
    "modelopt": "NVIDIA ModelOpt's FP8/FP4 layout is not read", "torchao": "torchao's tensor subclasses are not read",
    "vptq": "vector-quantized codebooks", "higgs": "Hadamard codebooks", "spqr": "sparse outliers",
    "fbgemm_fp8": "FBGEMM's FP8 layout is not read", "bitnet": "ternary weights", "auto-round": "auto-round's own layout",
}


@dataclass(frozen=True)
class WeightScheme:
    """How one linear's weight is stored: integer codes (bits, group_size; -1 = one group per row),
    with zero points or symmetric, act-order g_idx stored; or fp8 (served dense)."""
    kind: str                       # "int" | "fp8"
    bits: int
    group_size: int                 # -1: per output channel (one group of all K inputs); fp8: unused
    zero_point: bool                # asymmetric: zero points stored
    g_idx: bool = False             # an act-order permutation (g_idx) is stored
    static_input_scale: bool = False  # fp8: an input_scale is stored (ignored: activations stay unquantized)
    packed: bool = True             # compressed-tensors: pack-quantized (else int8 `weight` codes)


@dataclass
class HubQuantization:
    method: str                     # "awq" | "gptq" | "compressed-tensors"
    file: str                       # config.json, for messages
    scheme: WeightScheme | None = None          # awq / gptq: one for every quantized linear
    checkpoint_format: str = "gptq"             # gptq: "gptq" (v1: stored zeros are z - 1) or "gptq_v2"
    # compressed-tensors: (targets, scheme) in config_groups order, and the names left unquantized
    groups: list[tuple[list[str], WeightScheme]] = field(default_factory=list)
    ignore: list[str] = field(default_factory=list)

    def describe(self) -> str:
        if self.method == "mxfp4":
            return "mxfp4 (experts' blocks and scales, decoded where they are multiplied)"
        schemes = [self.scheme] if self.scheme else [s for _, s in self.groups]
        parts = sorted({("fp8 (served dense)" if s.kind == "fp8" else
                         f"int{s.bits} {'per channel' if s.group_size == -1 else f'group {s.group_size}'}"
                         f"{' asym' if s.zero_point else ' sym'}{' act-order (served dense)' if s.g_idx else ''}")
                        for s in schemes})
        return f"{self.method} ({', '.join(parts)})"

    def scheme_for(self, module: str) -> WeightScheme:
        """A linear's scheme, by its HF module name (compressed-tensors: the first config group whose
        targets match; "Linear" matches any linear, "re:" a regex, else the exact name)."""
        if self.scheme is not None:
            return self.scheme
        for targets, scheme in self.groups:
            if any(target_matches(t, module) for t in targets):
                return scheme
        raise CheckpointError(f"{self.file}: {module} holds quantized tensors but matches no config group's targets")


def target_matches(target: str, module: str) -> bool:
    if target == "Linear":
        return True
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == module


def read_quantization(raw: dict, file: str) -> HubQuantization | None:
    """config.json's quantization_config as pdserve serves it, None where there is none; refuses
    (CheckpointError, one line naming the method) what pdserve cannot serve exactly."""
    qc = raw.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise CheckpointError(f"{file}: quantization_config must be an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method is None and ("load_in_4bit" in qc or "load_in_8bit" in qc):
        method = "bitsandbytes"
    method = str(method).lower() if method is not None else None
    where = f"{file}: quantization_config quant_method {method!r}"
    if method not in SERVED:
        reason = NOT_SERVED.get(method, "unknown to pdserve")
        raise CheckpointError(f"{where} is not supported ({reason}); pdserve reads {', '.join(SERVED)}")
    if method == "awq":
        return _awq(qc, file, where)
    if method == "gptq":
        return _gptq(qc, file, where)
    if method == "mxfp4":   # gpt-oss's experts: the model reads the blocks and scales (quantization/mxfp4.py)
        if raw.get("architectures") != ["GptOssForCausalLM"]:
            _refuse(where, f"MXFP4 on {raw.get('architectures')} (pdserve reads it for GptOssForCausalLM's experts)")
        return HubQuantization("mxfp4", file, ignore=list(qc.get("modules_to_not_convert") or []))
    return _compressed(qc, file, where)


def _refuse(where: str, why: str):
    raise CheckpointError(f"{where} is not supported: {why}")


def _int(qc: dict, key: str, where: str, default=None) -> int:
    v = qc.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int):
        _refuse(where, f"{key} must be an integer, got {v!r}")
    return v


def _awq(qc: dict, file: str, where: str) -> HubQuantization:
    bits = _int(qc, "bits", where, qc.get("w_bit"))
    group = _int(qc, "group_size", where, qc.get("q_group_size"))
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        _refuse(where, f"AWQ version {version!r} (pdserve reads the GEMM packing)")
    if bits != 4:
        _refuse(where, f"AWQ with {bits}-bit weights (AWQ's GEMM packing is 4-bit)")
    if not qc.get("zero_point", True):
        _refuse(where, "AWQ without zero points (zero_point false)")
    if group <= 0:
        _refuse(where, f"AWQ group_size {group} (a positive group size is needed)")
    ignore = qc.get("modules_to_not_convert") or []
    return HubQuantization("awq", file, WeightScheme("int", 4, group, True), ignore=list(ignore))


def _gptq(qc: dict, file: str, where: str) -> HubQuantization:
    bits = _int(qc, "bits", where)
    group = _int(qc, "group_size", where, -1)
    if bits not in (4, 8):
        _refuse(where, f"GPTQ with {bits}-bit weights (pdserve serves 4 and 8)")
    if group != -1 and group <= 0:
        _refuse(where, f"GPTQ group_size {group}")
    fmt = str(qc.get("checkpoint_format") or "gptq").lower()
    if fmt not in ("gptq", "gptq_v2"):
        _refuse(where, f"GPTQ checkpoint_format {fmt!r} (pdserve reads gptq and gptq_v2)")
    if qc.get("dynamic"):
        _refuse(where, "GPTQModel's per-module `dynamic` overrides")
    if str(qc.get("pack_dtype", "int32")).replace("torch.", "") != "int32":
        _refuse(where, f"pack_dtype {qc.get('pack_dtype')!r} (pdserve reads int32 packing)")
    desc_act = bool(qc.get("desc_act", False))
    return HubQuantization("gptq", file, WeightScheme("int", bits, group, not qc.get("sym", True), g_idx=desc_act),
                           checkpoint_format=fmt, ignore=list(qc.get("modules_to_not_convert") or []))


def _compressed(qc: dict, file: str, where: str) -> HubQuantization:
    try:
        from compressed_tensors.quantization import QuantizationConfig
    except ImportError:
        raise CheckpointError(f"{where} needs the compressed-tensors package to read it: "
                              "pip install 'pdserve[quantization]'") from None
    # actorder "group" (weight_g_idx stored: groups not contiguous) is what llm-compressor wrote
    # before compressed-tensors dropped it (its validation now rejects it): read here, served dense
    qc = json.loads(json.dumps(qc))
    act_order_groups = set()
    for name, g in (qc.get("config_groups") or {}).items():
        if isinstance(g, dict) and isinstance(g.get("weights"), dict) and g["weights"].get("actorder") == "group":
            g["weights"]["actorder"] = None
            act_order_groups.add(name)
    try:
        config = QuantizationConfig.model_validate({k: v for k, v in qc.items()
                                                    if k not in ("quant_method", "version", "sparsity_config",
                                                                 "transform_config")})
    except Exception as e:   # pydantic's ValidationError: its first line names the field
        _refuse(where, f"unreadable config ({str(e).splitlines()[0]})")
    if qc.get("sparsity_config"):
        _refuse(where, "sparse (sparsity_config) weights")
    if qc.get("transform_config"):
        _refuse(where, "transforms (transform_config: rotations applied at run time)")
    status = str(getattr(config.quantization_status, "value", config.quantization_status))
    if status != "compressed":
        _refuse(where, f"quantization_status {status!r} (pdserve reads compressed checkpoints)")
    if config.kv_cache_scheme is not None:
        _refuse(where, "a quantized KV cache (kv_cache_scheme)")
    formats = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")
    groups = []
    for name, g in config.config_groups.items():
        fmt = getattr(g, "format", None) or config.format
        fmt = str(getattr(fmt, "value", fmt))
        if fmt not in formats:
            _refuse(where, f"config group {name}: format {fmt!r} (pdserve reads {', '.join(formats)})")
        w, a = g.weights, g.input_activations
        if w is None:
            _refuse(where, f"config group {name}: activation-only quantization")
        if g.output_activations is not None:
            _refuse(where, f"config group {name}: output activation quantization")
        strategy = getattr(w.strategy, "value", w.strategy)
        wtype = getattr(w.type, "value", w.type)
        if wtype == "float":
            if (w.num_bits, strategy) not in ((8, "tensor"), (8, "channel")):
                _refuse(where, f"config group {name}: {w.num_bits}-bit float weights with strategy {strategy} "
                               "(pdserve reads FP8 with per-tensor or per-channel scales)")
            if a is not None and (getattr(a.type, "value", a.type) != "float" or a.num_bits != 8):
                _refuse(where, f"config group {name}: FP8 weights with {a.num_bits}-bit {a.type} activations")
            scheme = WeightScheme("fp8", 8, -1, False, static_input_scale=a is not None and not a.dynamic)
        else:
            if a is not None:
                _refuse(where, f"config group {name}: integer weights with quantized activations "
                               f"(W{w.num_bits}A{a.num_bits}) cannot be served exactly without int8 activations")
            if w.num_bits not in (4, 8):
                _refuse(where, f"config group {name}: {w.num_bits}-bit integer weights (pdserve serves 4 and 8)")
            if strategy not in ("group", "channel"):
                _refuse(where, f"config group {name}: strategy {strategy!r} (pdserve reads group and channel)")
            scheme = WeightScheme("int", w.num_bits, w.group_size if strategy == "group" else -1,
                                  not w.symmetric, g_idx=name in act_order_groups, packed=fmt == "pack-quantized")
        groups.append((list(g.targets), scheme))
    if not groups:
        _refuse(where, "no config_groups")
    return HubQuantization("compressed-tensors", file, groups=groups, ignore=list(config.ignore or []))


def check_requested(quant: HubQuantization | None, requested: str | None) -> None:
    """--quantization on a checkpoint that is already quantized: refused (vLLM refuses conflicting methods)."""
    if quant is not None and requested:
        raise ConfigError(f"--quantization {requested}: {quant.file} is already quantized ({quant.describe()}); "
                          "serve it without --quantization")
