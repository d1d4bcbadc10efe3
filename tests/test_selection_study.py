"""The selection study's sampled blocks: the same name gives the same block, and a block is
scored with the decision granii made on the sampler's first block and the tie-break on its second."""
import torch

from scripts.selection_rules import reused
from scripts.validate_costmodels import (BLOCK_FANOUT, BLOCK_SEEDS, base_graph, block_index,
                                         study_graph)


def _global_edges(block):
    u, v = block.edges()
    return sorted(zip(block.srcdata["_ID"][u].tolist(), block.dstdata["_ID"][v].tolist()))


def test_study_blocks_are_fixed_neighbour_samples():
    a, again, other = (study_graph(n) for n in ("cora/block0", "cora/block0", "cora/block1"))
    assert a.is_block and a.num_dst_nodes() == BLOCK_SEEDS
    assert int(a.in_degrees().max()) <= BLOCK_FANOUT
    assert _global_edges(a) == _global_edges(again)
    assert all(torch.equal(x, y) for x, y in zip(a.edges(), again.edges()))   # same numbering
    assert torch.equal(a.srcdata["_ID"][:BLOCK_SEEDS], a.dstdata["_ID"])
    assert torch.equal(a.dstdata["_ID"], again.dstdata["_ID"])
    assert not set(a.dstdata["_ID"].tolist()) & set(other.dstdata["_ID"].tolist())
    assert not study_graph("cora").is_block
    assert base_graph("cora/block1") == "cora" and block_index("cora/block1") == 1
    assert block_index("cora") is None


def test_blocks_reuse_the_first_blocks_decision():
    def row(graph, mode="train"):
        return {"graph": graph, "layer": "SAGE", "k_in": 32, "k_out": 256, "mode": mode}
    rows = [row("pubmed/block2"), row("pubmed/block0"), row("pubmed/block1"), row("pubmed"),
            row("cora/block3"), row("pubmed/block1", "infer")]
    got = reused(rows)
    b2, b0, b1, whole, cora, infer = rows
    assert got[id(b2)] == (b0, b1) and got[id(b1)] == (b0, b1) and got[id(b0)] == (b0, b1)
    assert got[id(cora)] == (cora, cora) and got[id(infer)] == (infer, infer)
    assert id(whole) not in got



def test_repeated_feature_modes_keep_the_work_done_once_per_input():
    """``infer-same`` / ``train-same`` time a first layer on fixed features: the work kept per
    input survives between calls (a hidden layer's ``infer`` drops it before each call), the
    features need no gradient, and granii ranks with ``input_repeats``."""
    import dgl
    from dgl.nn import GraphConv

    from granii.plan import INPUT
    from scripts import validate_costmodels as vc

    def kept(gi):
        return {k: v[2] for k, v in gi.cache.items() if isinstance(k, tuple) and k[0] == "input"}
    g = dgl.add_self_loop(dgl.rand_graph(60, 300))
    for mode, repeats in (("infer", False), ("infer-same", True), ("train-same", True)):
        torch.manual_seed(0)
        layer = GraphConv(8, 16, norm="both", allow_zero_in_degree=True)
        call, feat = vc.prepared(layer, g, 8, mode)
        assert not feat.requires_grad
        assert vc.mode_flags(mode)["input_repeats"] is repeats
        key = next(k for k, (p, _) in vc.candidates(call).items()
                   if any(s.when == INPUT for s in p.steps))
        run = vc.candidate_fns(call, layer, feat, mode)[key]
        run()
        before = kept(call.gi)
        run()
        after = kept(call.gi)
        assert before and before.keys() == after.keys(), mode
        assert all((after[k] is v) is repeats for k, v in before.items()), mode
