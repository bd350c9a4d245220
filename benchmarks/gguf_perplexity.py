"""Perplexity of GGUF files in pdserve and in llama.cpp's `llama-perplexity`, on the same files.

    python -m benchmarks.gguf_perplexity [--model pdserve/data/default-model] [--types F32 Q8_0 Q4_K_M]

The text is the bundled default model's held-out stories (tools/train_default.py's 2% validation
split: the same seed-0 shuffle of its documents; the stories among them). The files are made as
users make them: convert_hf_to_gguf.py for F32 and Q8_0, llama-quantize for the rest
(benchmarks/peers.py). Both sides score the text as llama-perplexity does, so the numbers are
comparable: the text's tokens (with BOS) cut into disjoint chunks of --ctx tokens, each chunk's
first token replaced by BOS, the second half of each chunk scored with the first half as context;
PPL = exp(mean negative log-likelihood). pdserve runs the engine's forward (its CPU kernels where
built) in float32."""
import argparse
import json
import math
import os
import random
import re
import subprocess
import sys

import torch

from benchmarks import peers
from benchmarks.quant_accuracy import all_logprobs
from pdserve import LLM
from tools import CORPUS_DIR

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def held_out_stories() -> str:
    """The stories of tools/train_default.py's validation split (documents: stories, then dialogues)."""
    with open(os.path.join(CORPUS_DIR, "stories.txt"), encoding="utf-8") as f:
        stories = [s.strip() for s in f.read().split("\n\n") if s.strip()]
    with open(os.path.join(CORPUS_DIR, "dialogues.jsonl"), encoding="utf-8") as f:
        n_dialogues = sum(1 for _ in f)
    order = list(range(len(stories) + n_dialogues))
    random.Random(0).shuffle(order)
    held = order[:len(order) // 50]
    return "\n\n".join(stories[i] for i in held if i < len(stories))


def pdserve_ppl(gguf: str, text: str, ctx: int) -> tuple[float, int]:
    llm = LLM(gguf, dtype="float32", max_num_batched_tokens=max(512, ctx))
    tok = llm.tokenizer
    ids = tok.encode(text)   # with BOS, as llama-perplexity tokenizes
    first, nll, count = ctx // 2, 0.0, 0
    for c in range(len(ids) // ctx):
        chunk = ids[c * ctx:(c + 1) * ctx]
        if tok.bos_token_id is not None:
            chunk[0] = tok.bos_token_id
        logprobs = all_logprobs(llm, chunk)
        targets = torch.tensor(chunk[first + 1:])
        nll -= logprobs[first:ctx - 1].gather(1, targets[:, None]).sum().item()
        count += len(targets)
    return math.exp(nll / count), count


def llama_ppl(binary: str, gguf: str, text_file: str, ctx: int, threads: int, tries: int = 3) -> float:
    """llama-perplexity's final estimate (the running estimate after its last chunk, the same number)."""
    # -nr: no repacking of the weights for its CPU kernels; with it, this build (0.3.36's tree)
    # crashed (SIGSEGV) loading the default model's Q8_0 file on an Intel Xeon with AVX-512 and AMX.
    # Retries: its asynchronous logger did not always write the last lines before exiting.
    cmd = [binary, "-m", gguf, "-f", text_file, "-c", str(ctx), "-b", str(ctx), "-t", str(threads), "-nr"]
    for _ in range(tries):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        out = r.stdout + r.stderr
        chunks = re.search(r"calculating perplexity over (\d+) chunks", out)
        final = re.search(r"Final estimate: PPL = ([0-9.]+)", out)
        last = chunks and re.search(rf"\[{chunks.group(1)}\]([0-9.]+)", out)
        if r.returncode == 0 and (final or last):
            return float((final or last).group(1))
    raise RuntimeError(f"llama-perplexity failed ({r.returncode}): {out[-2000:]}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=os.path.join(REPO, "pdserve", "data", "default-model"))
    p.add_argument("--types", nargs="+", default=["F32", "Q8_0", "Q4_K_M"])
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--peers-dir", default=peers.DEFAULT_PEERS_DIR)
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "gguf_perplexity_{types}.json"))
    args = p.parse_args(argv)
    text = held_out_stories()
    work = os.path.join(args.peers_dir, "gguf")
    os.makedirs(work, exist_ok=True)
    text_file = os.path.join(work, "default-model-heldout.txt")
    with open(text_file, "w", encoding="utf-8") as f:
        f.write(text)
    binary = peers.install_llama_tool(args.peers_dir, "llama-perplexity")
    f32 = peers.convert_to_gguf(args.peers_dir, args.model, "f32", python=sys.executable)
    rows = []
    for qtype in args.types:
        if qtype == "F32":
            gguf = f32
        elif qtype == "Q8_0":
            gguf = peers.convert_to_gguf(args.peers_dir, args.model, "q8_0", python=sys.executable)
        else:
            gguf = peers.quantize_gguf(args.peers_dir, f32, qtype)
        ours, scored = pdserve_ppl(gguf, text, args.ctx)
        print(f"{qtype}: pdserve PPL {ours:.4f} over {scored} tokens", flush=True)
        theirs = llama_ppl(binary, gguf, text_file, args.ctx, args.threads)
        rows.append(dict(type=qtype, file=os.path.basename(gguf), bytes=os.path.getsize(gguf), pdserve=ours,
                         llama_cpp=theirs, rel_diff=ours / theirs - 1, tokens_scored=scored))
        print(json.dumps(rows[-1]), flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out.format(types="_".join(args.types)), "w") as f:
        json.dump(dict(model=args.model, ctx=args.ctx, chars=len(text), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
