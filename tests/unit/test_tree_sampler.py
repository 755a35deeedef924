"""DDTreeSampler (the runner's rejection sampler for DDTree): the one-launch walk and
the multi-launch walk give the same runner output and record the same accepted paths,
for a batch mixing tree requests, a request whose tree was cut short by the scheduler
and a plain decode without a tree."""

from __future__ import annotations

import inspect
import types

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.worker.gpu.sample.sampler import Sampler  # noqa: E402
from vllm.v1.worker.gpu.sample.states import NO_LOGPROBS  # noqa: E402

import vllm_ddtree.tree_verifier as spec_mod  # noqa: E402
from vllm_ddtree.tree_verifier import DDTreeSampler, TreeStep, TreeVerifier  # noqa: E402

DEPTH, BUDGET, VOCAB, STATES = 4, 7, 3, 6


def _num_sampled_and_rejected(num_output, seq_lens, cu, idx_mapping, prefill_len):
    # The runner's helper for decodes: all outputs count; rejected = verified - kept.
    n = num_output.shape[0]
    verified = (cu[1:n + 1] - cu[:n]).to(torch.int32)
    return num_output.to(torch.int32), verified - num_output.to(torch.int32)


def _fake_sampler(num_logprobs, logprobs_mode="raw_logprobs", processed=None):
    """A stand-in for vLLM's Sampler: its greedy ``sample`` accepts exactly the installed
    Sampler.sample's arguments (0.33.0 added idx_mapping and the sequence lengths), and
    whether logprobs are returned is decided by the installed Sampler's own method
    (0.26.0's returns_logprobs, 0.33.0's get_logprobs_dims) over per-request states
    asking for ``num_logprobs`` top logprobs (NO_LOGPROBS: none) and no token ids."""
    signature = inspect.signature(Sampler.sample)

    def sample(logits, *args, **kwargs):
        signature.bind(None, logits, *args, **kwargs)  # TypeError if the call is off
        return logits.argmax(-1), processed(logits) if processed else None

    fake = types.SimpleNamespace(
        compute_nans=False, logprobs_mode=logprobs_mode, sample=sample,
        sampling_states=types.SimpleNamespace(max_num_logprobs=lambda idx_np: num_logprobs),
        logprob_token_ids_state=types.SimpleNamespace(max_num_token_ids=lambda idx_np: 0),
        req_states=types.SimpleNamespace(prefill_len=types.SimpleNamespace(gpu=None)),
    )
    for name in ("returns_logprobs", "get_logprobs_dims"):
        if hasattr(Sampler, name):
            setattr(fake, name, types.MethodType(getattr(Sampler, name), fake))
    return fake


def _setup(device):
    g = torch.Generator().manual_seed(11)
    n = BUDGET + 1
    parents = torch.zeros(STATES, n, dtype=torch.int32)
    parents[:, 0] = -1
    for i in range(1, n):
        parents[:, i] = torch.randint(0, i, (STATES,), generator=g)
    tokens = torch.randint(0, VOCAB, (STATES, n), generator=g)
    valid = torch.ones(STATES, n, dtype=torch.bool)
    valid[1, 5:] = False  # a smaller tree in state 1
    # Batch: state 4 (full tree), state 1 (tree, 4 nodes scheduled), state 2 (no tree)
    idx = torch.tensor([4, 1, 2], dtype=torch.int32)
    rows_per_req = [n, 4, 1]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(rows_per_req)]), dtype=torch.int32)
    num_logits = int(cu[-1])
    logits = torch.randn(num_logits, VOCAB, generator=g)
    to = lambda t: t.to(device)  # noqa: E731
    local = torch.cat([torch.arange(k) for k in rows_per_req]).to(torch.int32)
    batch = types.SimpleNamespace(
        num_reqs=3, idx_mapping=to(idx), idx_mapping_np=idx.numpy(), cu_num_logits=to(cu),
        logits_indices=to(torch.arange(num_logits)), positions=to(torch.arange(num_logits) + 50),
        input_ids=to(torch.zeros(num_logits, dtype=torch.int64)),
        expanded_idx_mapping=to(idx.repeat_interleave(torch.tensor(rows_per_req))),
        expanded_local_pos=to(local), seq_lens=to(torch.tensor([60, 70, 80], dtype=torch.int32)),
        seq_lens_cpu_upper_bound=torch.tensor([60, 70, 80], dtype=torch.int32))
    return dict(parents=to(parents), tokens=to(tokens), valid=to(valid), logits=to(logits),
                batch=batch)


def _run(s, fused: bool):
    spec = TreeVerifier(STATES, BUDGET, DEPTH, 64, s["logits"].device, fused)
    spec.tokens_by_state, spec.parents_by_state, spec.valid_by_state = (
        s["tokens"], s["parents"], s["valid"])
    spec.step = TreeStep(next_budget=BUDGET, verified_rows=s["batch"].logits_indices)
    sampler = _fake_sampler(NO_LOGPROBS)  # greedy target samples, no logprobs
    # Positionally, every argument the installed vLLM's runner passes its rejection
    # sampler (0.33.0 adds the grammar's invalid-draft mask, None without a grammar).
    extra = [None] * (len(_rejection_sampler_params()) - 3)
    out = DDTreeSampler(sampler, spec)(s["logits"], s["batch"], *extra)
    return out, spec


def _rejection_sampler_params() -> list[str]:
    from vllm.v1.worker.gpu.spec_decode.rejection_sampler import RejectionSampler

    return list(inspect.signature(RejectionSampler.__call__).parameters)


def test_tree_sampler_takes_the_rejection_samplers_arguments():
    # The runner calls the tree sampler where it calls its rejection sampler, with
    # positional arguments: the installed pin's names in the same order; a parameter
    # only another pin passes defaults to None.
    want = _rejection_sampler_params()
    params = inspect.signature(DDTreeSampler.__call__).parameters
    assert list(params)[:len(want)] == want
    assert all(p.default is None for p in list(params.values())[len(want):])
    # 0.33.0's kernel warm-up reads this from its rejection sampler.
    assert DDTreeSampler.enable_adaptive_verification is False


def test_fused_and_unfused_walks_give_the_same_runner_output(triton_device, monkeypatch):
    monkeypatch.setattr(spec_mod, "get_num_sampled_and_rejected", _num_sampled_and_rejected)
    s = _setup(triton_device)
    (a, spec_a), (b, spec_b) = _run(s, True), _run(s, False)
    assert a.logprobs_tensors is None and b.logprobs_tensors is None  # none asked for
    assert torch.equal(a.num_sampled.cpu(), b.num_sampled.cpu())
    assert torch.equal(a.num_rejected.cpu(), b.num_rejected.cpu())
    n_out = a.num_sampled.cpu().tolist()
    for r, k in enumerate(n_out):
        # Outputs past num_output are padding and may differ between the paths.
        assert torch.equal(a.sampled_token_ids[r, :k].cpu(), b.sampled_token_ids[r, :k].cpu())
    step_a, step_b = spec_a.step, spec_b.step
    assert torch.equal(step_a.num_accepted.cpu(), step_b.num_accepted.cpu())
    for r, k in enumerate(step_a.num_accepted.cpu().tolist()):
        assert torch.equal(step_a.accepted_nodes[r, :k + 1].cpu(),
                           step_b.accepted_nodes[r, :k + 1].cpu())
    assert step_a.pending_compaction and step_b.pending_compaction
    # The plain decode (no tree) outputs exactly its one sampled token.
    assert n_out[2] == 1
    assert int(a.sampled_token_ids[2, 0]) == int(s["logits"][-1].argmax())
    # The fused outputs are contiguous rows the runner can copy to the host as they are.
    assert a.sampled_token_ids.is_contiguous() and a.num_sampled.is_contiguous()


def test_the_scenario_accepts_tree_nodes(triton_device, monkeypatch):
    """Guard for the comparison above: the greedy target does follow the trees."""
    monkeypatch.setattr(spec_mod, "get_num_sampled_and_rejected", _num_sampled_and_rejected)
    out, spec = _run(_setup(triton_device), True)
    accepted = spec.step.num_accepted.cpu().tolist()
    assert accepted[0] >= 1 and accepted[2] == 0


def test_logprobs_score_each_emitted_token_at_its_node(vllm_triton, triton_device, monkeypatch):
    """With logprobs asked for, row cu[r] + j holds request r's j-th output token scored
    on the logit row of the node it was sampled from (the accepted path's depth-j
    node), with vLLM's top-k and rank, as a chain's rejection sampler lays them out."""
    monkeypatch.setattr(spec_mod, "get_num_sampled_and_rejected", _num_sampled_and_rejected)
    s = _setup(triton_device)
    spec = TreeVerifier(STATES, BUDGET, DEPTH, 64, s["logits"].device, True)
    spec.tokens_by_state, spec.parents_by_state, spec.valid_by_state = (
        s["tokens"], s["parents"], s["valid"])
    spec.step = TreeStep(next_budget=BUDGET, verified_rows=s["batch"].logits_indices)
    cu = s["batch"].cu_num_logits
    s["batch"].cu_num_logits_np = cu.cpu().numpy()
    sampler = _fake_sampler(2, processed=lambda logits: logits)
    out = DDTreeSampler(sampler, spec)(s["logits"], s["batch"])
    lp = out.logprobs_tensors
    assert lp is not None and lp.cu_num_generated_tokens == cu.cpu().tolist()
    logits = s["logits"].cpu().float()
    step = spec.step
    checked = 0
    for r, k in enumerate(out.num_sampled.cpu().tolist()):
        for j in range(k):
            node = int(step.accepted_nodes[r, j])
            row, src = int(cu[r]) + j, int(cu[r]) + node
            token = int(out.sampled_token_ids[r, j])
            want = torch.log_softmax(logits[src], -1)
            assert int(lp.logprob_token_ids[row, 0]) == token
            assert float(lp.logprobs[row, 0]) == pytest.approx(float(want[token]), abs=1e-5)
            top = torch.topk(logits[src], 2).indices.tolist()
            assert lp.logprob_token_ids[row, 1:].cpu().tolist() == top
            assert int(lp.selected_token_ranks[row]) == int((logits[src] > logits[src][token]).sum()) + 1
            checked += 1
    # The greedy target followed the tree: some output came from a node below the root.
    assert checked > len(out.num_sampled) and int(step.num_accepted[0]) >= 1
