import json

import pytest

from falcon_vllm.tree import DecodingTree, build_tree, chain_paths, full_tree_paths


def test_paper_trees_match_reference_sizes():
    v = build_tree("falcon-vicuna", 2)
    assert v.num_nodes == 165 and v.max_depth == 8 and v.num_passes == 4
    assert v.rows_per_pass() == [2, 14, 22, 24]          # FALCON_REFERENCE 4.5
    assert v.leaf_paths.shape[0] == 91
    ll = build_tree("falcon-llama", 2)
    assert ll.num_nodes == 118 and ll.rows_per_pass() == [2, 12, 14, 14]
    assert ll.leaf_paths.shape[0] == 75
    assert ll.describe()["nodes_per_depth"] == [20, 19, 19, 15, 16, 10, 10, 9]


@pytest.mark.parametrize("bad,msg", [
    ([], "no paths"), ([[]], "depth 0"), ([[0], [0]], "duplicate"), ([[0, 1]], "no parent"),
    ([[-1]], "negative"), ([[0.5]], "not an integer"), ([3], "list of ranks"),
])
def test_invalid_trees_raise_clear_errors(bad, msg):
    with pytest.raises(ValueError, match=msg):
        DecodingTree(bad, 2)


def test_invalid_k():
    with pytest.raises(ValueError, match="k must be"):
        DecodingTree([[0]], 0)


def test_rank_values_are_honoured_and_tensors_consistent():
    t = DecodingTree([[0], [3], [3, 5], [0, 1], [0, 1, 2]], k=1)
    assert t.nodes == [(0,), (3,), (0, 1), (3, 5), (0, 1, 2)]
    assert t.rank.tolist() == [-1, 0, 3, 1, 5, 2]       # not renumbered
    assert t.parent.tolist() == [-1, 0, 0, 1, 2, 3]
    assert t.depth.tolist() == [0, 1, 1, 2, 2, 3]
    assert t.topk == 6
    m = t.ancestor_mask
    assert m[5].tolist() == [True, True, False, True, False, True]   # root, [0], [0,1], self
    assert m[:, 0].all() and m.diagonal().all()
    assert (m & m.T).sum() == t.num_slots                             # antisymmetric off-diagonal
    assert t.leaf_paths.tolist() == [[2, 4, -1], [1, 3, 5]]


def test_drafting_plan_k2():
    # levels 1-2 from pass 1; pass 2 expands depth-2 nodes with children
    t = DecodingTree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 0, 0, 0]], k=2)
    assert t.num_passes == 2
    p2 = t.passes[1]
    assert [t.nodes[s - 1] for s in p2.expansion_slots.tolist()] == [(0, 0), (0, 1)]
    # block inputs are the tokens on levels 1..2 of each expansion node's path
    assert [[t.nodes[s - 1] for s in row] for row in p2.input_slots.tolist()] == [[(0,), (0, 0)], [(0,), (0, 1)]]
    assert p2.feature_rows.tolist() == [[0, 1], [0, 1]]
    src = {t.nodes[i]: tuple(r) for i, r in enumerate(t.node_source.tolist())}
    assert src[(1,)] == (0, 0, 1) and src[(1, 0)] == (0, 1, 0)
    assert src[(0, 0, 1)] == (1, 0, 1) and src[(0, 1, 0)] == (1, 2, 0) and src[(0, 0, 0, 0)] == (1, 1, 0)


def test_k3_plan_and_parent_blocks():
    t = build_tree("tree-2x2x2x2x2x2x1", 3)
    assert t.num_passes == 3
    for q in (1, 2):
        pl = t.passes[q]
        assert pl.input_slots.shape == (pl.num_blocks, 3)
        for b in range(pl.num_blocks):
            e = t.nodes[pl.expansion_slots[b] - 1]
            assert len(e) == 3 * q
            if q == 2:  # its ancestor block in pass 2 expands e's depth-3 prefix
                parent = t.passes[1].expansion_slots[pl.parent_block[b]]
                assert t.nodes[parent - 1] == e[:3]


def test_presets_and_specs():
    assert build_tree("chain-5", 2).is_chain and build_tree("chain-5", 2).num_nodes == 5
    assert build_tree("[[0],[1],[0,0]]", 1).num_nodes == 3
    assert build_tree("tree-3x2", 1).num_nodes == 9
    assert build_tree([[0]], 1).num_nodes == 1
    assert chain_paths(3) == [[0], [0, 0], [0, 0, 0]]
    assert len(full_tree_paths([2, 2])) == 6
    with pytest.raises(ValueError, match="unknown tree"):
        build_tree("nope", 2)
    # a pattern is sized before it is built: a typo must not build 10^9 paths
    for spec in ("tree-1000x1000x1000", "chain-1000000"):
        with pytest.raises(ValueError, match="far more than a step can verify"):
            build_tree(spec, 2)


def test_malformed_tree_files_give_one_error_naming_the_file(tmp_path):
    from falcon_vllm.tree import read_tree_file

    f = tmp_path / "t.json"
    for content, err in [({"paths": [[0]], "by_batch_size": {"4": [[0]]}}, r"by_batch_size\['4'\] must be"),
                         ({"by_batch_size": [[1, [[0]]]]}, "'by_batch_size' must map batch sizes"),
                         ({"by_batch_size": {"four": {"paths": [[0]]}}}, "batch size 'four' is not a positive"),
                         ({"by_batch_size": {"04": {"paths": [[0]]}}}, "batch size '04' is not a positive"),
                         ({"by_batch_size": {"0": {"paths": []}}}, "batch size '0' is not a positive"),
                         ({"tree": 5}, "'paths' must be a list of rank paths"),
                         ({"paths": [[0]], "k": "2"}, "'k' .* must be an integer >= 1"),
                         (5, "expected a list of rank paths or a JSON object")]:
        f.write_text(json.dumps(content))
        with pytest.raises(ValueError, match=err) as e:
            read_tree_file(str(f))
        assert str(f) in str(e.value)
    f.write_text(json.dumps({"k": 2, "paths": [[0], [1]], "by_batch_size": {"2": {"paths": [[0]]},
                                                                           "1": {"paths": [[0], [1]]}}}))
    got = read_tree_file(str(f))
    assert got.tuned and got.k == 2 and got.by_batch_size == [(1, [[0], [1]]), (2, [[0]])]
    f.write_text("[[0], [0, 0]]")
    assert read_tree_file(str(f)).paths == [[0], [0, 0]] and not read_tree_file(str(f)).tuned


def test_tree_file(tmp_path):
    f = tmp_path / "t.json"
    f.write_text('{"paths": [[0], [0, 0], [1]]}')
    assert build_tree(str(f), 2).num_nodes == 3
