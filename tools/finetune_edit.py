"""Fine-tune a checkpoint to follow `pdserve bench --dataset-name edit`'s instruction: write the
text above out again. The bundled model continues a story from memory instead, so n-gram
speculation rarely hits; an instruction-following model repeats the text, which is what
speculative decoding's edit and summarize workloads rely on.

    python -m tools.finetune_edit pdserve/data/default-model /work/edit-model --minutes 10

Training texts are new: sentences of the corpus's stories drawn at random and strung together,
from stories that are not in the bench's story pool, so the bench's prompts are never a
training example. Each example is the edit prompt (text, instruction, the text's first
sentence) followed by the rest of the text; the loss is on that answer only. AdamW at a
constant learning rate for a wall-clock budget; bf16 autocast, fp32 weights saved.
"""
import argparse
import json
import os
import random
import shutil
import time

import torch

from pdserve.bench.datasets import EDIT_INSTRUCTION, POOL_TEXT
from tools import CORPUS_DIR
from tools.widen_model import copy_tokenizer


def sentences(held_out: set[str]) -> list[str]:
    """The sentences of the corpus's stories that are not in `held_out`."""
    with open(os.path.join(CORPUS_DIR, "stories.txt"), encoding="utf-8") as f:
        stories = [s.strip() for s in f.read().split("\n\n") if s.strip() and s.strip() not in held_out]
    return [s if s.endswith(".") else s + "." for story in stories for s in story.split(". ") if len(s) > 3]


def example(rng: random.Random, pool: list[str], tok, max_words: int) -> tuple[list[int], int]:
    """Token ids of one edit example, and where its answer starts."""
    words = []
    while len(words) < rng.randint(20, max_words):
        words += rng.choice(pool).split()
    text = " ".join(words)
    first = text.split(". ")[0] + "."
    prompt = tok.encode(f"{text}\n\n{EDIT_INSTRUCTION}\n\n{first}")
    answer = tok.encode(text[len(first):], add_special_tokens=False) + [tok.eos_token_ids[0]]
    return prompt + answer, len(prompt)


def batch_of(examples: list[tuple[list[int], int]], pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = max(len(ids) for ids, _ in examples)
    x = torch.full((len(examples), n), pad, dtype=torch.long)
    labels = torch.full_like(x, -100)
    mask = torch.zeros_like(x)
    for row, (ids, start) in enumerate(examples):
        x[row, :len(ids)] = torch.tensor(ids)
        labels[row, start:len(ids)] = x[row, start:len(ids)]
        mask[row, :len(ids)] = 1
    return x, labels, mask


def finetune(src: str, out: str, minutes: float, batch: int, lr: float, max_words: int, seed: int,
             threads: int, max_steps: int | None = None) -> dict:
    import transformers

    from pdserve.tokenizer import Tokenizer
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    tok = Tokenizer.from_dir(src)
    with open(POOL_TEXT, encoding="utf-8") as f:
        held_out = {s.strip() for s in f.read().split("\n\n") if s.strip()}
    pool = sentences(held_out)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng = random.Random(seed)
    model.train()
    step, ema, start = 0, None, time.time()
    while time.time() - start < minutes * 60 and (max_steps is None or step < max_steps):
        x, labels, mask = batch_of([example(rng, pool, tok, max_words) for _ in range(batch)], tok.eos_token_ids[0])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=x, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % 20 == 0:
            print(f"step {step} {(time.time() - start) / 60:.1f}min answer loss {ema:.3f}", flush=True)
    tmp = out.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    copy_tokenizer(src, tmp)
    log = {"source": os.path.abspath(src), "minutes": minutes, "steps": step, "batch": batch, "lr": lr,
           "max_words": max_words, "seed": seed, "final_answer_loss_ema": None if ema is None else round(ema, 4), "held_out_stories": len(held_out)}
    with open(os.path.join(tmp, "finetune_log.json"), "w") as f:
        json.dump(log, f, indent=2)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return log


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.finetune_edit", description=__doc__.splitlines()[0])
    p.add_argument("src", help="checkpoint to start from (e.g. the bundled default model)")
    p.add_argument("out", help="directory to write the fine-tuned checkpoint to")
    p.add_argument("--minutes", type=float, default=10.0, help="wall-clock training budget")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--max-words", type=int, default=160, help="longest training text, in words")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps, within the budget")
    a = p.parse_args(argv)
    log = finetune(a.src, a.out, a.minutes, a.batch, a.lr, a.max_words, a.seed, a.threads, a.max_steps)
    print(json.dumps(log, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
