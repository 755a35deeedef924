"""Verification walk: vectorised vs Python reference, special cases, losslessness."""

from __future__ import annotations

import pytest
import torch

from vllm_ddtree.tree_builder import build_trees
from vllm_ddtree.tree_walk import TreeWalk, walk_tree
from tests.references import walk_tree_reference


def _assert_same_walk(ref: TreeWalk, got: TreeWalk) -> None:
    for name, a, b in zip(TreeWalk._fields, ref, got):
        assert a.dtype == b.dtype, f"{name}: {a.dtype} vs {b.dtype}"
        assert torch.equal(a, b.cpu()), f"{name}:\nref={a}\ngot={b}"


def _walk_both(tree, target, max_depth, pad_id=-1):
    args = (tree.node_tokens, tree.node_parents, tree.node_valid, target, max_depth)
    ref = walk_tree_reference(*args, pad_id=pad_id)
    got = walk_tree(*args, pad_id=pad_id)
    _assert_same_walk(ref, got)
    return got


def _check_walk_semantics(tree, target, walk, max_depth):
    """Independent checks: the accepted nodes form a root path of matching tokens and
    the walk stops exactly where no valid child matches."""
    for r in range(tree.node_tokens.shape[0]):
        k = int(walk.num_accepted[r])
        path = walk.accepted_nodes[r, : k + 1].tolist()
        assert path[0] == 0 and all(x == -1 for x in walk.accepted_nodes[r, k + 1 :].tolist())
        for d in range(1, k + 1):
            c, p = path[d], path[d - 1]
            assert bool(tree.node_valid[r, c])
            assert int(tree.node_parents[r, c]) == p
            assert int(tree.node_tokens[r, c]) == int(target[r, p])
            assert int(walk.output_tokens[r, d - 1]) == int(tree.node_tokens[r, c])
        last = path[-1]
        assert int(walk.output_tokens[r, k]) == int(target[r, last])
        assert int(walk.num_output[r]) == k + 1
        if k < max_depth:
            kids = (tree.node_parents[r] == last) & tree.node_valid[r]
            assert not bool((kids & (tree.node_tokens[r] == target[r, last])).any())


@pytest.mark.parametrize("seed", range(4))
def test_random_trees_match_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    R, D, V, B = 16, 4, 3, 12
    logits = torch.randn(R, D, V, generator=gen)
    tree = build_trees(logits, B, backend="torch", root_tokens=torch.randint(0, V, (R,), generator=gen))
    # targets biased towards the draft's favourites so that walks go deep
    target = torch.randint(0, V, (R, B + 1), generator=gen)
    greedy = logits.argmax(-1)  # [R, D]
    depth_of = tree.node_depths.long().clamp(max=D - 1)
    follow = torch.rand(R, B + 1, generator=gen) < 0.6
    target = torch.where(follow, greedy.gather(1, depth_of), target)
    walk = _walk_both(tree, target, D)
    _check_walk_semantics(tree, target, walk, D)
    assert walk.num_accepted.max() >= 2, "test should exercise deep acceptance"


def test_budget_padding_nodes_never_accepted():
    # Root, one real node (token 5) and three padding nodes (token 0, parent 0).
    tokens = torch.tensor([[9, 5, 0, 0, 0]])
    parents = torch.tensor([[-1, 0, 0, 0, 0]])
    valid = torch.tensor([[True, True, False, False, False]])
    target = torch.tensor([[0, 3, 0, 0, 0]])  # the target wants token 0 after the root
    args = (tokens, parents, valid, target, 3)
    walk = walk_tree(*args)
    _assert_same_walk(walk_tree_reference(*args), walk)
    assert walk.num_accepted.tolist() == [0]
    assert walk.output_tokens.tolist() == [[0, -1, -1, -1]]
    # built trees with padding (V = 2, D = 2 holds 6 of 10 nodes)
    tree = build_trees(torch.randn(4, 2, 2), 10, backend="torch")
    assert (~tree.node_valid).sum() == 16
    target = torch.zeros(4, 11, dtype=torch.int64)
    walk = _walk_both(tree, target, 2)
    acc = walk.accepted_nodes.clamp(min=0)
    assert tree.node_valid.gather(1, acc).all()


def test_greedy_chain_special_case():
    # top_k = 1 gives a chain: node i (1..D) has parent i - 1. At T = 0 the target's
    # tokens are its argmax continuations; accept the longest matching prefix.
    gen = torch.Generator().manual_seed(5)
    R, D = 32, 6
    tree = build_trees(torch.randn(R, D, 4, generator=gen), D, top_k=1, backend="torch")
    assert torch.equal(tree.node_parents[:, 1:], torch.arange(D, dtype=torch.int32).expand(R, D))
    draft = tree.node_tokens[:, 1:]
    match_len = torch.randint(0, D + 1, (R,), generator=gen)
    target = torch.randint(0, 4, (R, D + 1), generator=gen)
    for r in range(R):
        m = int(match_len[r])
        target[r, :m] = draft[r, :m]
        if m < D and target[r, m] == draft[r, m]:
            target[r, m] = (draft[r, m] + 1) % 4
    walk = _walk_both(tree, target, D)
    assert torch.equal(walk.num_accepted.long(), match_len)
    for r in range(R):
        m = int(match_len[r])
        assert walk.output_tokens[r, :m].tolist() == draft[r, :m].tolist()
        assert int(walk.output_tokens[r, m]) == int(target[r, m])
        assert walk.accepted_nodes[r, : m + 1].tolist() == list(range(m + 1))


def test_all_rejected_and_full_depth():
    gen = torch.Generator().manual_seed(9)
    R, D, V, B = 8, 5, 6, 20
    logits = torch.randn(R, D, V, generator=gen)
    logits[..., 0] += 5.0  # peaked: the tree reaches depth D
    tree = build_trees(logits, B, backend="torch")
    # all rejected: the target wants a token no node carries
    target = torch.full((R, B + 1), V + 3, dtype=torch.int64)
    walk = _walk_both(tree, target, D, pad_id=-7)
    assert walk.num_accepted.tolist() == [0] * R
    assert walk.accepted_nodes[:, 1:].eq(-1).all() and walk.accepted_nodes[:, 0].eq(0).all()
    assert walk.output_tokens[:, 0].eq(V + 3).all() and walk.output_tokens[:, 1:].eq(-7).all()
    # full depth: follow the deepest node's root path
    target = torch.full((R, B + 1), V + 3, dtype=torch.int64)
    for r in range(R):
        node = int(tree.node_depths[r].argmax())
        assert int(tree.node_depths[r, node]) == D
        while node > 0:
            p = int(tree.node_parents[r, node])
            target[r, p] = tree.node_tokens[r, node]
            node = p
    walk = _walk_both(tree, target, D)
    assert walk.num_accepted.tolist() == [D] * R
    assert walk.num_output.tolist() == [D + 1] * R
    assert walk.accepted_nodes.ge(0).all()


def test_max_depth_caps_the_walk_and_pad_id():
    tokens = torch.tensor([[0, 1, 2, 3, 4]])
    parents = torch.tensor([[-1, 0, 1, 2, 3]])
    valid = torch.ones(1, 5, dtype=torch.bool)
    target = torch.tensor([[1, 2, 3, 4, 5]])
    for max_depth in range(0, 6):
        args = (tokens, parents, valid, target, max_depth)
        walk = walk_tree(*args, pad_id=99)
        _assert_same_walk(walk_tree_reference(*args, pad_id=99), walk)
        k = min(max_depth, 4)
        assert int(walk.num_accepted[0]) == k
        assert walk.output_tokens.shape == (1, max_depth + 1)
        assert walk.output_tokens[0].tolist() == list(range(1, k + 2)) + [99] * (max_depth - k)


def test_duplicate_sibling_tokens_take_lowest_index():
    tokens = torch.tensor([[0, 7, 7, 8]])
    parents = torch.tensor([[-1, 0, 0, 2]])
    valid = torch.ones(1, 4, dtype=torch.bool)
    target = torch.tensor([[7, 8, 8, 0]])
    walk = _walk_both(tree=type("T", (), dict(node_tokens=tokens, node_parents=parents, node_valid=valid)), target=target, max_depth=2)
    assert walk.accepted_nodes.tolist() == [[0, 1, -1]]


def test_bad_inputs():
    t = torch.zeros(2, 4, dtype=torch.int64)
    v = torch.ones(2, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="target_tokens"):
        walk_tree(t, t, v, torch.zeros(2, 5, dtype=torch.int64), 3)
    with pytest.raises(TypeError, match="node_valid"):
        walk_tree(t, t, t, t, 3)
    with pytest.raises(ValueError, match="max_depth"):
        walk_tree(t, t, v, t, -1)


@pytest.mark.parametrize(
    "randomness,lossless", [("per_node", True), ("per_depth", True), ("shared", False)]
)
def test_walk_is_lossless_at_positive_temperature(randomness, lossless):
    """Monte Carlo check of the docstring argument on a toy target.

    Target: p(next | last token, depth) = softmax(W[last, depth]) over V = 3 tokens.
    Each trial verifies a fixed DDTree with one target sample per node (inverse CDF on
    uniforms), walks it, and completes the first three tokens with fresh target
    samples where the walk emitted fewer. The three-token histogram must match the
    exact target distribution (chi-square, 26 dof). Sharing randomness between nodes
    of one depth is fine; sharing it across depths (negative control) is not, and the
    test detects that, so it has power.
    """
    V, D, B, N = 3, 3, 8, 60000
    gen = torch.Generator().manual_seed(1234)
    W = torch.randn(V, D + 1, V, generator=gen) * 0.8
    cond = torch.softmax(W, -1).double()  # [last, depth, next]
    root = 0
    tree = build_trees(torch.randn(1, D, V, generator=gen), B, backend="torch", root_tokens=torch.tensor([root]))
    n = B + 1
    probs = cond[tree.node_tokens[0], tree.node_depths[0].long()]  # [n, V]
    cdf = probs.cumsum(-1)

    def sample(cdf_rows, u):
        return (u[..., None] > cdf_rows).sum(-1).clamp(max=V - 1)

    if randomness == "per_node":
        u = torch.rand(N, n, generator=gen, dtype=torch.float64)
    elif randomness == "per_depth":
        u = torch.rand(N, D + 1, generator=gen, dtype=torch.float64)[:, tree.node_depths[0].long()]
    else:
        u = torch.rand(N, 1, generator=gen, dtype=torch.float64).expand(N, n)
    target = sample(cdf[None], u)  # [N, n]
    expand = lambda t: t.expand(N, n)  # noqa: E731
    walk = walk_tree(expand(tree.node_tokens), expand(tree.node_parents), expand(tree.node_valid), target, D)

    toks = walk.output_tokens[:, :3].clone()
    for j in range(3):
        missing = walk.num_output <= j
        prev = toks[:, j - 1] if j > 0 else torch.full((N,), root)
        fresh = sample(cond[prev, j].cumsum(-1), torch.rand(N, generator=gen, dtype=torch.float64))
        toks[:, j] = torch.where(missing, fresh, toks[:, j])

    cells = toks[:, 0] * V * V + toks[:, 1] * V + toks[:, 2]
    observed = torch.bincount(cells, minlength=V**3).double()
    a, b, c = torch.meshgrid(torch.arange(V), torch.arange(V), torch.arange(V), indexing="ij")
    exact = cond[root, 0, a] * cond[a, 1, b] * cond[b, 2, c]
    expected = (exact * N).reshape(-1)
    assert expected.min() > 5, "toy model too skewed for a chi-square test"
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert walk.num_accepted.max() >= 2
    if lossless:
        assert chi2 < 70.0, f"chi2={chi2:.1f} (26 dof): walk is not lossless"
    else:
        assert chi2 > 200.0, f"chi2={chi2:.1f}: negative control not detected"
