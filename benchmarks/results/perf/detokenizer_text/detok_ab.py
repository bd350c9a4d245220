# IncrementalDetokenizer.add per token (byte-level tokenizer, warm), HEAD's class against this tree's, alternating
import subprocess, statistics, timeit, types
from pdserve import tokenizer as new_mod
old_mod = types.ModuleType("old_tokenizer")
exec(compile(subprocess.run(["git", "show", "HEAD:pdserve/tokenizer.py"], capture_output=True, text=True, check=True).stdout, "old_tokenizer", "exec"), old_mod.__dict__)
tok = new_mod.Tokenizer.from_dir("/work/q05")
ids = tok.encode(open("README.md").read())[:256]
def run(cls):
    d = cls(tok, ids[:8])
    for t in ids: d.add(t)
res = {"old": [], "new": []}
for r in range(15):
    for name, cls in (("old", old_mod.IncrementalDetokenizer), ("new", new_mod.IncrementalDetokenizer))[:: 1 if r % 2 else -1]:
        res[name].append(timeit.timeit(lambda: run(cls), number=100) / 100 / len(ids) * 1e9)
o, n = statistics.median(res["old"]), statistics.median(res["new"])
print(f"old {o:.0f} ns, new {n:.0f} ns per token: {n / o:.2f}x")
