"""lm-evaluation-harness against `pdserve serve`, run as its users run it (the `lm_eval` CLI,
`--model local-completions` and `local-chat-completions`), on small local tasks written here
(YAML over JSONL, --include_path; no hub). Its per-example log-likelihoods, with --log_samples,
equal transformers' on the same checkpoint and tokens (fp32, 1e-4)."""
import glob
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import hf_logits

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is the `eval` extra (.ci/run installs it)")

QUESTIONS = [
    ("Where does the fox live?", ["in the woods", "on the moon", "under the sea"], 0),
    ("What color is the sky?", ["green", "blue"], 1),
    ("How many legs has a cat?", ["four", "two", "seven", "none"], 0),
    ("Who tells the story?", ["the old man", "a little girl"], 1),
]

MC_TASK = """task: pdserve_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""

GEN_TASK = """task: pdserve_tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def server(start_server, tiny_llama):
    return start_server(tiny_llama, "--dtype", "float32", "--max-num-batched-tokens", "16")


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    d = tmp_path_factory.mktemp("lm-eval-tasks")
    data = d / "data.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    (d / "mc.yaml").write_text(MC_TASK.format(data=data))
    (d / "gen.yaml").write_text(GEN_TASK.format(data=data))
    return str(d)


def lm_eval(tmp_path, *args: str) -> list[dict]:
    """Run the lm_eval CLI offline; its logged samples."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf-home"), "TOKENIZERS_PARALLELISM": "false"}
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "lm_eval", "run", *args, "--log_samples", "--output_path", str(out)],
                       capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    files = glob.glob(str(out / "**" / "samples_*.jsonl"), recursive=True)
    assert len(files) == 1, files
    with open(files[0]) as f:
        return [json.loads(line) for line in f]


def test_multiple_choice_loglikelihoods_equal_transformers(server, tiny_llama, tasks, tmp_path):
    from transformers import AutoTokenizer
    model = os.path.basename(tiny_llama)
    samples = lm_eval(tmp_path, "--model", "local-completions", "--tasks", "pdserve_tiny_mc",
                      "--include_path", tasks,
                      "--model_args", f"base_url={server.url}/v1/completions,model={model},"
                                      f"tokenizer_backend=huggingface,tokenizer={tiny_llama},max_retries=1")
    assert len(samples) == len(QUESTIONS)
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    checked = 0
    for s in samples:
        # one request per choice: {"gen_args_i": {"arg_0": context, "arg_1": continuation}}, [[ll, is_greedy]]
        for args, resp in zip(s["arguments"].values(), s["resps"]):
            context, continuation = args["arg_0"], args["arg_1"]
            ll = float(resp[0][0])
            # the harness's own split: encode context and context + continuation without special tokens
            ctx = tok(context, add_special_tokens=False)["input_ids"]
            cont = tok(context + continuation, add_special_tokens=False)["input_ids"][len(ctx):]
            lp = torch.log_softmax(hf_logits(tiny_llama, ctx + cont), dim=-1)
            ref = sum(lp[len(ctx) + j - 1, t].item() for j, t in enumerate(cont))
            assert abs(ll - ref) < 1e-4, (context, continuation, ll, ref)
            checked += 1
    assert checked == sum(len(c) for _, c, _ in QUESTIONS)


def test_chat_generation_task_runs_to_completion(server, tiny_llama, tasks, tmp_path):
    model = os.path.basename(tiny_llama)
    samples = lm_eval(tmp_path, "--model", "local-chat-completions", "--tasks", "pdserve_tiny_gen",
                      "--include_path", tasks, "--apply_chat_template",
                      "--model_args", f"base_url={server.url}/v1/chat/completions,model={model},max_retries=1")
    assert len(samples) == len(QUESTIONS)
    assert all(isinstance(s["resps"][0][0], str) for s in samples)
