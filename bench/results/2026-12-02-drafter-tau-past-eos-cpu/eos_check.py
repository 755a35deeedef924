import sys, gzip, json, time, torch
sys.path.insert(0, '/work/main')
torch.set_num_threads(2)
from transformers import AutoModelForCausalLM
from bench.fixture.dflash_drafter import DFlashDrafter
from bench.fixture.train_dflash_drafter import Packed, accept_lengths, chain_tau
NS, NH, NEW = int(sys.argv[1]), int(sys.argv[2]), 128
d = json.load(gzip.open('/work/main/.payload/drafter/eval/drafter-eval-responses.json.gz', 'rt'))
resp = d['responses'][:NS] + d['responses'][200:200 + NH]
prompts = [ids[:p] for ids, p in resp]
m = AutoModelForCausalLM.from_pretrained('/tmp/smollm2-hf', dtype=torch.float32).eval()
m.generation_config.eos_token_id = None
t = time.time()
gens = []
B = 8
for s in range(0, len(prompts), B):
    ch = prompts[s:s + B]; P = max(map(len, ch))
    ids = torch.full((len(ch), P), 2); att = torch.zeros((len(ch), P), dtype=torch.long)
    for i, p in enumerate(ch):
        ids[i, P - len(p):] = torch.tensor(p); att[i, P - len(p):] = 1
    with torch.no_grad():
        out = m.generate(input_ids=ids, attention_mask=att, max_new_tokens=NEW, do_sample=False,
                         pad_token_id=2, eos_token_id=None, temperature=None, top_p=None, top_k=None)
    gens += out[:, P:].tolist()
    print('gen', s, round(time.time() - t), flush=True)
def feats(seqs):
    out = []
    for sq in seqs:
        with torch.no_grad():
            hs = m.model(input_ids=torch.tensor([sq]), output_hidden_states=True, use_cache=False).hidden_states
        out.append(torch.cat([hs[k + 1][0] for k in (1, 14, 27)], -1))
    return out
dr = DFlashDrafter.load_vllm('/work/main/bench/fixture/smollm2-dflash').eval()
embed, lm = m.model.embed_tokens.weight.detach(), m.lm_head.weight.detach()
from contextlib import nullcontext
res = {}
for name, sl in (('sharegpt', slice(0, NS)), ('humaneval', slice(NS, None))):
    P, G = prompts[sl], gens[sl]
    stopped = [g[:g.index(2) + 1] if 2 in g else g for g in G]      # offline protocol (stop at EOS), 128 cap
    forced = G                                                       # engine protocol: ignore_eos, 128
    post = sum(len(g) - len(s_) for g, s_ in zip(forced, stopped))
    for proto, R in (('stop_at_eos', stopped), ('ignore_eos', forced)):
        items = [(p + r, len(p)) for p, r in zip(P, R) if len(r) >= 2]
        pk = Packed([s_ for s_, _ in items], [p_ for _, p_ in items], feats([s_ for s_, _ in items]), torch.device('cpu'))
        r = chain_tau(accept_lengths(dr, pk, embed, lm, torch.device('cpu'), nullcontext, rows_per=1))
        res[f'{name}/{proto}'] = {k: r[k] for k in ('tau', 'steps', 'tokens', 'sequences')}
        print(name, proto, res[f'{name}/{proto}'], flush=True)
    res[f'{name}/post_eos_token_share'] = round(post / sum(map(len, forced)), 4)
    # tau over post-EOS region only: simulate with the accept lengths of forced seqs from first EOS on
print(json.dumps(res, indent=1))
