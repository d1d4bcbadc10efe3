"""Small test graphs of every kind the plans must handle."""
import dgl
import torch


def directed(n=40, m=200, seed=0):
    """Random directed graph with a self-loop on every node (no zero in-degree)."""
    return dgl.add_self_loop(dgl.remove_self_loop(_rand(n, m, seed)))


def _rand(n, m, seed):
    gen = torch.Generator().manual_seed(seed)
    u = torch.randint(0, n, (m,), generator=gen)
    v = torch.randint(0, n, (m,), generator=gen)
    return dgl.graph((u, v), num_nodes=n)


def undirected(n=40, m=120, seed=1):
    g = dgl.to_bidirected(_rand(n, m, seed))
    return dgl.add_self_loop(dgl.remove_self_loop(g))


def zero_in_degree(n=40, m=150, seed=2):
    """Directed graph where the last quarter of the nodes have no in-edges (and some no out-edges)."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.randint(0, n, (m,), generator=gen)
    v = torch.randint(0, 3 * n // 4, (m,), generator=gen)
    g = dgl.graph((u, v), num_nodes=n)
    assert (g.in_degrees() == 0).any()
    return g


def block(seed=3):
    """A block (bipartite message-flow graph) from DGL's neighbour sampler: N_dst < N_src."""
    g = undirected(60, 300, seed)
    sampler = dgl.dataloading.NeighborSampler([4])
    seeds = torch.arange(0, 12)
    _, _, blocks = sampler.sample_blocks(g, seeds)
    return blocks[0]


def edge_weights(g, seed=4):
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(g.num_edges(), generator=gen) + 0.1


GRAPHS = {"directed": directed, "undirected": undirected, "zero_in_degree": zero_in_degree}
