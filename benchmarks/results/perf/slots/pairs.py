# Per-pair new/old ratios of ab.sh printouts (overhead, output phase, step), and each side sorted.
# usage: pairs.py FILE...
import re, statistics, sys
for f in sys.argv[1:]:
    rows=[]
    for line in open(f):
        w=line.split()[0]
        ov=float(re.search(r"overhead\(med diff\) (\d+)",line).group(1)); out=float(re.search(r"output ([\d.]+)",line).group(1)); st=float(re.search(r"step (\d+)",line).group(1))
        rows.append((w,ov,out,st))
    pairs=[rows[i:i+2] for i in range(0,len(rows),2)]
    r={k:[] for k in ("overhead","output","step")}
    for p in pairs:
        d={w:(ov,out,st) for w,ov,out,st in p}
        for i,k in enumerate(r): r[k].append(d['new'][i]/d['old'][i])
    print(f)
    for k,v in r.items(): print(f"  {k} new/old", " ".join(f"{x:.2f}" for x in v), "median", round(statistics.median(v),3))
    for w in ("old","new"):
        print("  ", w, "overhead", sorted(ov for ww,ov,_,_ in rows if ww==w), "output", sorted(o for ww,_,o,_ in rows if ww==w))
