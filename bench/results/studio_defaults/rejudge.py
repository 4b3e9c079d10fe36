"""Re-judge the recorded outputs with engine/finish.py: python bench/results/studio_defaults/rejudge.py A B C D E"""
import json, sys
from engine.finish import judge
rows=[("shipped/default","bench/results/long_measures_shipped/results.json")]+[(n,f"bench/results/studio_defaults/{n}/results.json") for n in sys.argv[1:]]
print("setting | set | stop | loop(new rule) | complete | right | tpf all | tpf complete | mean tok")
for name,path in rows:
    r=json.load(open(path))
    for x in r["results"]:
        for pre in ("long","checkable"):
            outs=x.get(f"{pre}_outputs") or []
            if not outs: continue
            n=len(outs)
            j=[judge(o["output"], o["stop_reason"]) for o in outs]
            comp=[o for o,f in zip(outs,j) if f.complete]
            tpf_c=sum(o["answer_tokens"] for o in comp)/max(1,sum(o["nfe"] for o in comp)) if comp else None
            right=x.get(f"{pre}_right")
            print(name, x["mode"], pre, f"{x[pre+'_stop_rate']:.2f}", f"{sum(f.looping for f in j)/n:.2f}", f"{len(comp)}/{n}", right, f"{x[pre+'_tokens_per_forward']:.2f}", None if tpf_c is None else round(tpf_c,3), round(x[pre+'_mean_answer_tokens'],1))
