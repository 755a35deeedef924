import sys, gzip, json, torch
sys.path.insert(0, '/work/main')
torch.set_num_threads(2)
from contextlib import nullcontext
from transformers import AutoModelForCausalLM
from bench.fixture.dflash_drafter import DFlashDrafter
from bench.fixture.train_dflash_drafter import Packed, accept_lengths, chain_tau
NS, NH = int(sys.argv[1]), int(sys.argv[2])
d = json.load(gzip.open('/work/main/.payload/drafter/eval/drafter-eval-responses.json.gz', 'rt'))
m = AutoModelForCausalLM.from_pretrained('/tmp/smollm2-hf', dtype=torch.float32).eval()
dr = DFlashDrafter.load_vllm('/work/main/bench/fixture/smollm2-dflash').eval()
embed, lm = m.model.embed_tokens.weight.detach(), m.lm_head.weight.detach()
def feats(seqs):
    out = []
    for sq in seqs:
        with torch.no_grad():
            hs = m.model(input_ids=torch.tensor([sq]), output_hidden_states=True, use_cache=False).hidden_states
        out.append(torch.cat([hs[k + 1][0] for k in (1, 14, 27)], -1))
    return out
for name, R in (('sharegpt', d['responses'][:NS]), ('humaneval', d['responses'][200:200 + NH])):
    for cap in (256, 128):
        items = [(ids[:p + cap], p) for ids, p in R]
        pk = Packed([s for s, _ in items], [p for _, p in items], feats([s for s, _ in items]), torch.device('cpu'))
        r = chain_tau(accept_lengths(dr, pk, embed, lm, torch.device('cpu'), nullcontext, rows_per=1))
        print(name, 'stored HF-bf16 responses, stop at EOS, cap', cap, {k: r[k] for k in ('tau', 'steps', 'tokens')}, flush=True)
