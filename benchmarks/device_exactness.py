"""The device check's exactness phase (benchmarks/device_check.py).

For each test architecture (make_model's tiny checkpoints: every entry of pdserve/models' registry
is among them, and gpt-oss with its experts in MXFP4), on the device under test:

- fp32: pdserve's greedy tokens for prompts of 1 to 200 tokens, run as one batch (the long prompt
  prefilled in chunks beside the others' decodes), equal transformers' generate() on the same
  device, prompt by prompt and token for token;
- bf16: pdserve's logprob of every prompt token after the first and of every generated token,
  against transformers' bf16 forward over the same tokens on the same device, is within
  LOGPROB_TOL: at most twice (mean and largest gap) bf16's own error on that model, i.e.
  transformers' bf16 against its own fp32 forward, which is recorded beside it.
"""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
import traceback

import torch

from tools.make_model import ARCHS, corpus_prompts, make_model

PROMPT_LENS = (1, 7, 17, 64, 200)   # beyond the tiny models' windows (16 to 48) and the step budget
NEW_TOKENS = 12
STEP_BUDGET = 64    # max_num_batched_tokens: the 200-token prompt takes 4 chunks
# bf16 against bf16: |pdserve's logprob - transformers' logprob| over every prompt and sampled
# position, its mean and its largest, each within `rel` times the same figure of transformers' bf16
# against its own fp32 forward (bf16's own error on that model), or within the floor where that is
# smaller. A fixed figure would not do: a mixture of experts in bf16 routes some tokens to other
# experts than in fp32 (transformers' own bf16 is up to 14 nats off its fp32 at such a token). On
# the CPU (torch's ops against transformers, every variant, 2026-12-03) every variant was within:
# the largest ratios were 1.16 (olmo2's mean gap, 0.073 nats) and 1.40 (gpt-oss's largest gap); the
# dense models' gaps were at most 0.073 nats on average and 0.37 at the largest.
LOGPROB_TOL = {"rel": 2.0, "mean_floor": 0.05, "max_floor": 0.5}


def variants() -> dict[str, tuple[str, dict]]:
    """name -> (make_model arch, its options): every test architecture, llama first."""
    names = {arch: (arch, {}) for arch in ("llama", *[a for a in ARCHS if a != "llama"])}
    names["gpt_oss-mxfp4"] = ("gpt_oss", {"mxfp4": True})
    return names


def reference_model(path: str, dtype: torch.dtype, device: str):
    """transformers' model of the checkpoint on the device: a vision-language checkpoint through its
    image-text class (its text-only forward), an MXFP4 one dequantized (the reference's own kernels
    for MXFP4 on a GPU come from the Hub, which the device cannot reach)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    config = AutoConfig.from_pretrained(path)
    auto = AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
    kwargs = {}
    if (getattr(config, "quantization_config", None) or {}).get("quant_method") == "mxfp4":
        from transformers import Mxfp4Config
        kwargs["quantization_config"] = Mxfp4Config(dequantize=True)
    return auto.from_pretrained(path, dtype=dtype, **kwargs).to(device).eval()


@torch.inference_mode()
def reference_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' generate(), greedy, one prompt at a time (no padding)."""
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


@torch.inference_mode()
def reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log-softmax of one full forward's logits (no cache), in fp32, on the CPU: [len(ids), vocab]."""
    logits = model(torch.tensor([ids], device=model.device), use_cache=False).logits[0]
    return torch.log_softmax(logits.float(), dim=-1).cpu()


def compare_tokens(ours: list[list[int]], reference: list[list[int]]) -> dict:
    """Token-for-token comparison of each prompt's continuation. 'equal' needs every token of every
    prompt equal and at least one token compared; the first difference is named."""
    compared, first = 0, None
    for i, (a, b) in enumerate(zip(ours, reference, strict=True)):
        for j in range(max(len(a), len(b))):
            x, y = (a[j] if j < len(a) else None), (b[j] if j < len(b) else None)
            if x != y and first is None:
                first = dict(prompt=i, position=j, ours=x, reference=y)
            compared += 1
    return dict(tokens_compared=compared, equal=first is None and compared > 0, first_difference=first)


def logprob_gaps(ours: list[float], reference: list[float]) -> dict:
    """Largest and mean |ours - reference| over the positions, and where the largest is."""
    gaps = [abs(a - b) for a, b in zip(ours, reference, strict=True)]
    if not gaps:
        return dict(positions=0, max=None, mean=None, argmax=None)
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    return dict(positions=len(gaps), max=gaps[worst], mean=sum(gaps) / len(gaps), argmax=worst)


def within_tolerance(gaps: dict, bf16_error: dict) -> bool:
    """gaps (pdserve bf16 against transformers bf16) within LOGPROB_TOL of bf16_error (transformers
    bf16 against its fp32) at the same positions."""
    t = LOGPROB_TOL
    return (bool(gaps["positions"]) and gaps["positions"] == bf16_error["positions"]
            and gaps["mean"] <= max(t["mean_floor"], t["rel"] * bf16_error["mean"])
            and gaps["max"] <= max(t["max_floor"], t["rel"] * bf16_error["max"]))


def engine(path: str, device: str, dtype: str):
    from pdserve import LLM
    kv_blocks = 8 * -(-(max(PROMPT_LENS) + NEW_TOKENS) // 16) + 8    # every prompt at once, whole
    kwargs = dict(device=device, dtype=dtype, max_num_batched_tokens=STEP_BUDGET, max_num_seqs=8,
                  num_kv_blocks=kv_blocks, block_size=16)
    if device == "cpu":
        kwargs["cpu_kernels"] = False   # the dry run: torch's ops, nothing to compile, deterministic
    return LLM(path, **kwargs)


def fp32_tokens(path: str, device: str) -> dict:
    from pdserve import SamplingParams
    t0 = time.perf_counter()
    llm = engine(path, device, "float32")
    prompts = corpus_prompts(llm.tokenizer, PROMPT_LENS)
    # as the tests run it: both stop at the checkpoint's EOS tokens
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0))
    ours = [o.token_ids for o in outs]
    chunked = max(o.metrics.num_prefill_steps for o in outs) > 1
    backend = llm.engine.runner.backend.describe()
    # the reference runs in this process after pdserve: fp32 matmuls as pdserve left them (TF32 would
    # not be fp32), recorded
    precision = dict(float32_matmul_precision=torch.get_float32_matmul_precision(),
                     cuda_matmul_allow_tf32=torch.backends.cuda.matmul.allow_tf32,
                     cudnn_allow_tf32=torch.backends.cudnn.allow_tf32)
    del llm, outs
    free(device)
    t1 = time.perf_counter()
    model = reference_model(path, torch.float32, device)
    reference = [reference_greedy(model, p, NEW_TOKENS) for p in prompts]
    del model
    free(device)
    return dict(compare_tokens(ours, reference), ours=ours, reference=reference, prompt_lens=list(PROMPT_LENS),
                chunked_prefill=chunked, backend=backend, precision=precision, pdserve_s=round(t1 - t0, 2),
                reference_s=round(time.perf_counter() - t1, 2))


def bf16_logprobs(path: str, device: str) -> dict:
    """pdserve's bf16 prompt and sample logprobs against transformers' bf16 (and fp32) forward over
    the same tokens: pdserve's own continuation, so the two never diverge."""
    from pdserve import SamplingParams
    llm = engine(path, device, "bfloat16")
    prompts = [p for p in corpus_prompts(llm.tokenizer, PROMPT_LENS) if len(p) > 1]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    outs = llm.generate(prompts, params)
    del llm
    free(device)
    refs = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        model = reference_model(path, dtype, device)
        refs[name] = [reference_logprobs(model, p + o.token_ids) for p, o in zip(prompts, outs)]
        del model
        free(device)
    ours, theirs, fp32 = [], [], []
    for k, (p, o) in enumerate(zip(prompts, outs)):
        seq = p + o.token_ids
        # position i's logprob is of token i given the tokens before it: row i - 1 of the forward
        ours += [o.prompt_logprobs[i][p[i]].logprob for i in range(1, len(p))]
        ours += [o.logprobs[j][t] for j, t in enumerate(o.token_ids)]
        rows = range(1, len(seq))
        theirs += [refs["bf16"][k][i - 1, seq[i]].item() for i in rows]
        fp32 += [refs["fp32"][k][i - 1, seq[i]].item() for i in rows]
    gaps, bf16_error = logprob_gaps(ours, theirs), logprob_gaps(theirs, fp32)
    top1 = sum(o.token_ids[0] == int(refs["bf16"][k][len(p) - 1].argmax()) for k, (p, o) in enumerate(zip(prompts, outs)))
    return dict(gaps, within_tolerance=within_tolerance(gaps, bf16_error), reference_bf16_vs_fp32=bf16_error,
                first_token_equal=f"{top1}/{len(prompts)}")


def free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def check_variant(name: str, device: str, work_dir: str) -> dict:
    """One variant, in a process of its own: its checkpoint, then the fp32 and bf16 comparisons."""
    arch, opts = variants()[name]
    v = dict(arch=arch)
    t0 = time.monotonic()
    try:
        path = make_model(os.path.join(work_dir, f"tiny-{name}"), arch, force=True, **opts)
    except Exception as e:  # noqa: BLE001 - recorded
        return dict(v, status="checkpoint failed", error=f"{type(e).__name__}: {e}"[:500])
    v.update(architecture=declared(work_dir, name), checkpoint_s=round(time.monotonic() - t0, 1))
    for part, check in (("fp32_tokens", fp32_tokens), ("bf16_logprobs", bf16_logprobs)):
        try:
            v[part] = check(path, device)
        except Exception as e:  # noqa: BLE001 - a failing architecture is a result
            v[part] = dict(error=f"{type(e).__name__}: {e}"[:500], traceback=traceback.format_exc()[-2000:])
            free(device)
    ok = v["fp32_tokens"].get("equal") is True and v["bf16_logprobs"].get("within_tolerance") is True
    return dict(v, status="ok" if ok else "failed", seconds=round(time.monotonic() - t0, 1))


def run(out_path: str, device: str, work_dir: str, names: list[str], deadline: float, workers: int) -> dict:
    """Every variant in `names`, `workers` at a time, each in a process of its own (a device fault in
    one architecture cannot poison the next; tiny models leave a GPU mostly idle, so they overlap).
    Written to out_path as each finishes; one still running at `deadline` is stopped, and one not
    yet started then is skipped, each saying so."""
    from benchmarks.device_records import load, log_tail, save
    rec = dict(phase="exactness", device=device, prompt_lens=list(PROMPT_LENS), new_tokens=NEW_TOKENS,
               logprob_tolerance=LOGPROB_TOL, workers=workers, variants={n: dict(arch=variants()[n][0], status="not run") for n in names})
    save(out_path, rec)
    queue, running, slowest = list(names), {}, 0.0
    try:
        while queue or running:
            # start no variant that the slowest so far says would not finish in time
            while queue and len(running) < workers and time.time() + slowest < deadline:
                name = queue.pop(0)
                out = os.path.join(work_dir, f"exact-{name}.json")
                if os.path.exists(out):
                    os.remove(out)
                cmd = [sys.executable, "-m", "benchmarks.device_exactness", name, device, work_dir, out]
                with open(out[:-5] + ".log", "w", encoding="utf-8") as log:   # the child keeps it open
                    running[name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                                      stdin=subprocess.DEVNULL), out)
            time.sleep(0.2)
            for name, (proc, out) in list(running.items()):
                if proc.poll() is None and time.time() < deadline:
                    continue
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                    rec["variants"][name]["status"] = "stopped at the phase's time limit"
                else:   # a process that died without its record (a crash on the device) failed
                    rec["variants"][name] = load(out) or dict(
                        rec["variants"][name], status="failed", architecture=declared(work_dir, name),
                        error=f"exit status {proc.returncode}", log_tail=log_tail(out[:-5] + ".log"))
                    slowest = max(slowest, rec["variants"][name].get("seconds", 0))
                del running[name]
                save(out_path, rec)
            if queue and not running and time.time() + slowest >= deadline:
                for name in queue:
                    rec["variants"][name]["status"] = "skipped: out of time"
                queue = []
    finally:   # stopped from outside (SIGTERM at the phase's limit): no variant outlives the phase
        for proc, _ in running.values():
            proc.kill()
    # the registry's architectures that no checked variant declares (a vision-language checkpoint
    # declares its image-text class, which pdserve serves as its text part: it covers no text class)
    from pdserve.models import ARCHITECTURES
    checked = {v.get("architecture") for v in rec["variants"].values() if v["status"] in ("ok", "failed")}
    rec["registry_not_covered"] = sorted(set(ARCHITECTURES) - checked)
    save(out_path, rec)
    return rec


def declared(work_dir: str, name: str) -> str | None:
    """The architecture a variant's checkpoint declares, where it was made."""
    try:
        with open(os.path.join(work_dir, f"tiny-{name}", "config.json")) as f:
            return json.load(f)["architectures"][0]
    except (OSError, ValueError, KeyError):
        return None


if __name__ == "__main__":   # one variant: NAME DEVICE WORK_DIR OUT (run() starts these)
    from benchmarks.device_records import save
    save(sys.argv[4], check_variant(*sys.argv[1:4]))
