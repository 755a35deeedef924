import sys, json, gzip, time, torch
sys.path.insert(0, '/work/main')
from bench.fixture.train_dflash_drafter import Target, eval_prompts
torch.manual_seed(0)
tgt = Target('/tmp/fx/smollm2-hf', torch.device('cpu'), torch.float32)
prompts = eval_prompts(tgt, '/tmp/fx/smollm2-fixture/data', 24, 24, 384)
flat = [p for n in prompts for p in prompts[n]]
mode = sys.argv[1]
t = time.time()
if mode == 'greedy':
    res = tgt.generate(flat, 256, 8)
else:
    res = []
    g = torch.Generator().manual_seed(1234)
    for i, p in enumerate(flat):
        torch.manual_seed(1000 + i)
        out = tgt.model.generate(input_ids=torch.tensor([p]), max_new_tokens=256, do_sample=True,
                                 temperature=1.0, top_k=0, top_p=1.0, pad_token_id=tgt.pad,
                                 eos_token_id=tgt.eos)
        gen = out[0, len(p):].tolist()
        if tgt.eos in gen: gen = gen[:gen.index(tgt.eos) + 1]
        res.append((p + gen, len(p)))
print(mode, len(res), sum(len(a)-b for a,b in res), 'tokens', round(time.time()-t,1), 's', flush=True)
with gzip.open(f'/tmp/t1/{mode}.json.gz', 'wt') as f:
    json.dump({"max_new_tokens": 256, "responses": [[list(a), b] for a, b in res]}, f)
