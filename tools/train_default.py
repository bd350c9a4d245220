"""Train the bundled default model: a small Llama on the shipped corpus, on CPU, within a time budget.

    python -m tools.train_default --out pdserve/data/default-model --minutes 18

The tokenizer is a 4096-token byte-level BPE trained on tools/corpus with the Llama
family conventions of make_model (<s> BOS, </s> EOS, ChatML chat template ending turns with
<|im_end|>). Stories are trained as "<s> story </s>", dialogues as rendered by the chat template,
all packed into fixed-length windows. The learning rate follows a cosine over the wall-clock
budget, so the run ends on time whatever the machine's speed (the step count therefore varies
between runs). Matmuls run in bf16 autocast; the saved weights are fp32. Results go to
docs/DEFAULT_MODEL.md; the run writes train_log.json next to the weights.
"""
import argparse
import json
import math
import os
import random
import shutil
import time

import torch

from pdserve.data import DEFAULT_MODEL_DIR
from tools import CORPUS_DIR
from tools.make_model import corpus_texts, save_tokenizer, train_tokenizer

SHAPE = dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
             intermediate_size=704, max_position_embeddings=1024, rope_theta=10000.0)
SAMPLE_PROMPTS = ["Once upon a time", "One day, Lily found a"]


def load_documents(tok) -> list[list[int]]:
    """Token ids of every story (with BOS/EOS) and every dialogue (as the chat template renders it)."""
    docs = []
    with open(os.path.join(CORPUS_DIR, "stories.txt"), encoding="utf-8") as f:
        for story in f.read().split("\n\n"):
            if story.strip():
                docs.append(tok.encode(story.strip()) + [tok.token_to_id("</s>")])
    with open(os.path.join(CORPUS_DIR, "dialogues.jsonl"), encoding="utf-8") as f:
        for line in f:
            docs.append(tok.encode_chat(json.loads(line), add_generation_prompt=False))
    return docs


def windows(stream: list[int], seq_len: int) -> torch.Tensor:
    n = (len(stream) - 1) // seq_len
    return torch.tensor(stream[:n * seq_len], dtype=torch.long).view(n, seq_len)


@torch.no_grad()
def evaluate(model, data: torch.Tensor, batch: int) -> float:
    model.eval()
    losses = [model(input_ids=data[i:i + batch], labels=data[i:i + batch]).loss.item()
              for i in range(0, len(data), batch)]
    model.train()
    return sum(losses) / len(losses)


@torch.no_grad()
def greedy_samples(model, tok, max_new_tokens: int = 60) -> dict[str, str]:
    out = {}
    for prompt in SAMPLE_PROMPTS:
        ids = torch.tensor([tok.encode(prompt)])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False)
        out[prompt] = prompt + tok.decode(gen[0, ids.shape[1]:].tolist())
    chat = [{"role": "user", "content": "What sound does a cow make?"}]
    ids = torch.tensor([tok.encode_chat(chat)])
    gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=False)
    out["chat: What sound does a cow make?"] = tok.decode(gen[0, ids.shape[1]:].tolist())
    return out


def train(out_dir: str, minutes: float, vocab_size: int, seq_len: int, batch: int, lr: float, seed: int,
          threads: int) -> dict:
    import transformers

    from pdserve.tokenizer import Tokenizer

    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    tmp_dir = out_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    os.makedirs(tmp_dir)

    t0 = time.time()
    save_tokenizer(train_tokenizer("llama", vocab_size, corpus_texts()), "llama", tmp_dir,
                   SHAPE["max_position_embeddings"])
    tok = Tokenizer.from_dir(tmp_dir)
    docs = load_documents(tok)
    random.Random(seed).shuffle(docs)
    n_val = len(docs) // 50
    val = windows([i for d in docs[:n_val] for i in d], seq_len)
    train_stream = [i for d in docs[n_val:] for i in d]
    print(f"tokenizer + data: {time.time() - t0:.0f}s, {len(train_stream)} train tokens, {val.numel()} val tokens")

    config = transformers.LlamaConfig(
        vocab_size=tok.vocab_size, tie_word_embeddings=True, rms_norm_eps=1e-5, dtype="float32",
        bos_token_id=tok.bos_token_id, eos_token_id=tok.token_to_id("</s>"), **SHAPE)
    model = transformers.LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    val_start = evaluate(model, val, batch)
    print(f"{n_params / 1e6:.2f}M params, initial val loss {val_start:.3f}")

    budget, warmup = minutes * 60, 30
    gen = torch.Generator().manual_seed(seed)
    step, tokens, ema, history = 0, 0, None, []
    start = time.time()
    model.train()
    while (elapsed := time.time() - start) < budget:
        # Cosine over the wall-clock budget, down to 10% of the peak, after a short warmup.
        frac = elapsed / budget
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))
        offsets = torch.randint(0, len(train_stream) - seq_len, (batch,), generator=gen).tolist()
        x = torch.tensor([train_stream[o:o + seq_len] for o in offsets])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step, tokens = step + 1, tokens + x.numel()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if step % 50 == 0:
            history.append({"step": step, "minutes": round(elapsed / 60, 2), "train_loss": round(ema, 4)})
            print(f"step {step} {elapsed / 60:.1f}min tokens {tokens} loss {ema:.3f}", flush=True)
    train_seconds = time.time() - start

    model.eval()
    val_end = evaluate(model, val, batch)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=[tok.token_to_id("</s>"), tok.token_to_id("<|im_end|>")])
    samples = greedy_samples(model, tok)
    model.save_pretrained(tmp_dir, safe_serialization=True)
    log = {
        "params": n_params, "shape": SHAPE, "vocab_size": tok.vocab_size, "seq_len": seq_len, "batch": batch,
        "peak_lr": lr, "seed": seed, "threads": threads, "budget_minutes": minutes,
        "train_minutes": round(train_seconds / 60, 2), "steps": step, "tokens_seen": tokens,
        "train_tokens": len(train_stream), "val_loss_start": round(val_start, 4), "val_loss_end": round(val_end, 4),
        "final_train_loss_ema": round(ema, 4), "history": history, "greedy_samples": samples,
    }
    with open(os.path.join(tmp_dir, "train_log.json"), "w", encoding="utf-8") as f:
        json.dump(log, f, indent=2, ensure_ascii=False)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp_dir, out_dir)
    return log


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=DEFAULT_MODEL_DIR)
    p.add_argument("--minutes", type=float, default=18.0, help="wall-clock training budget")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    log = train(args.out, args.minutes, args.vocab_size, args.seq_len, args.batch, args.lr, args.seed, args.threads)
    print(json.dumps({k: v for k, v in log.items() if k != "history"}, indent=2, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
