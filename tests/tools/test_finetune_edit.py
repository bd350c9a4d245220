"""`python -m tools.finetune_edit`: examples shaped as the bench's edit prompts, none of the bench's
stories among them, and a checkpoint that loads."""
import os
import random

import pytest
import torch
import transformers
from safetensors.torch import load_file

from pdserve.bench.datasets import EDIT_INSTRUCTION, POOL_TEXT
from pdserve.tokenizer import Tokenizer
from tools import CORPUS_DIR
from tools.finetune_edit import batch_of, example, finetune, sentences


@pytest.fixture(scope="module")
def bench_stories():
    with open(POOL_TEXT, encoding="utf-8") as f:
        return {s.strip() for s in f.read().split("\n\n") if s.strip()}


def test_examples_are_edit_prompts_with_the_text_as_answer(tiny_llama, bench_stories):
    tok = Tokenizer.from_dir(tiny_llama)
    pool = sentences(bench_stories)
    ids, start = example(random.Random(0), pool, tok, max_words=60)
    prompt, answer = tok.decode(ids[:start]), tok.decode(ids[start:])
    text, instruction, first = prompt.split("\n\n")
    assert instruction == EDIT_INSTRUCTION and text.startswith(first)
    assert (first + answer).split() == text.split()   # the answer writes the rest of the text out again
    assert ids[-1] in tok.eos_token_ids


def test_no_bench_story_is_a_training_text(bench_stories):
    assert sentences(bench_stories) != []
    with open(os.path.join(CORPUS_DIR, "stories.txt"), encoding="utf-8") as f:
        everything = {s.strip() for s in f.read().split("\n\n") if s.strip()}
    assert sentences(everything) == []   # held-out stories give no sentences at all


def test_loss_only_on_the_answer():
    x, labels, mask = batch_of([([5, 6, 7, 8], 2), ([5, 6, 7], 1)], pad=0)
    assert x.tolist() == [[5, 6, 7, 8], [5, 6, 7, 0]]
    assert labels.tolist() == [[-100, -100, 7, 8], [-100, 6, 7, -100]]
    assert mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]


def test_a_few_steps_change_the_weights_and_save_a_checkpoint(tiny_llama, tmp_path):
    out = str(tmp_path / "edit")
    log = finetune(tiny_llama, out, minutes=5, batch=2, lr=1e-3, max_words=30, seed=0, threads=1, max_steps=2)
    assert log["steps"] == 2
    before = load_file(os.path.join(tiny_llama, "model.safetensors"))
    after = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    name = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(before[name], after[name])
    assert os.path.exists(os.path.join(out, "tokenizer.json"))
