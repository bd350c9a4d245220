# the streamed output loop: current (append_token + make_output per sequence) against an inlined
# variant, alternating in one process (ABBA), tiny model, batch 32
import sys, time, statistics
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import ListPrefix, RequestOutput
from pdserve.engine.sequence import SequenceStatus
from pdserve.sampling_params import SamplingParams
e = LLMEngine("pdserve/data/default-model")
ids = list(range(5, 5 + 128))
proc = e.processor
FIN = SequenceStatus.FINISHED

def loop_current(self, sampled, now, outputs):
    for seq, token, logprobs in sampled:
        self.processor.append_token(seq, token, logprobs, now)
        if seq.finish_reason is not None:
            self.scheduler.finish(seq, seq.finish_reason)
            outputs.append(self._finish(seq, token))
        elif not seq.final_only:
            outputs.append(self.processor.make_output(seq, [token]))

def loop_inlined(self, sampled, now, outputs):
    p = self.processor
    append, make = p.append_token, p.make_output
    out_append = outputs.append
    for seq, token, logprobs in sampled:
        # the common streamed token inline: no logprobs, text every step, nothing stops it
        d = seq.detokenizer
        if (logprobs is None and not seq.defer_text and seq.stop_ids is not None and d._pieces is not None
                and token not in seq.stop_ids and not seq.params.stop and len(seq.token_ids) + 1 < seq.max_len
                and not seq.final_only and seq.metrics.first_token_time is not None):
            seq.token_ids.append(token)
            seq.metrics.token_times.append(now)
            delta = d.add(token)
            seq.text += delta
            seq.text_tokens += 1
            text = seq.text
            new_text = text[seq.sent_text_len:]
            seq.sent_text_len = len(text)
            out_append(RequestOutput(seq.request_id, seq.prompt_token_ids,
                                     ListPrefix(seq.token_ids, seq.num_prompt_tokens, len(seq.token_ids)), text,
                                     [token], new_text, None, False, None, seq.metrics, None))
            continue
        append(seq, token, logprobs, now)
        if seq.finish_reason is not None:
            self.scheduler.finish(seq, seq.finish_reason)
            out_append(self._finish(seq, token))
        elif not seq.final_only:
            out_append(make(seq, [token]))

variant = {"current": loop_current, "inlined": loop_inlined}
cur = ["current"]
T = {"current": [], "inlined": []}
def step(self):
    outputs = []
    start = time.perf_counter()
    sched = self.scheduler.schedule(start)
    sampled = self.runner.execute(sched)
    for seq, n in zip(sched.seqs, sched.num_tokens):
        seq.num_computed_tokens += n
    now = time.perf_counter()
    variant[cur[0]](self, sampled, now, outputs)
    T[cur[0]].append(time.perf_counter() - now)
    return outputs
for rid in range(32):
    e.add_request(str(rid), ids, SamplingParams(max_tokens=850, temperature=0, ignore_eos=True))
while e.scheduler.waiting or any(s.is_prefill for s in e.scheduler.running):
    e.step()
# same outputs?
import copy
rounds = []
for r in range(24):
    order = ["current", "inlined"] if r % 2 == 0 else ["inlined", "current"]
    for name in order:
        cur[0] = name
        T[name] = []
        for _ in range(12):
            step(e)
        rounds.append((r, name, statistics.median(T[name])))
cur_m = [x[2] for x in rounds if x[1] == "current"]
inl_m = [x[2] for x in rounds if x[1] == "inlined"]
ratios = [b / a for a, b in zip(cur_m, inl_m)]
print("current", f"{1e6*statistics.median(cur_m):.1f} us", "inlined", f"{1e6*statistics.median(inl_m):.1f} us",
      "inlined/current per round median", f"{statistics.median(ratios):.3f}", "range", f"{min(ratios):.2f}-{max(ratios):.2f}")
