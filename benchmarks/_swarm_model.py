"""The pieces of ``swarm_sim.py``: model shapes, volunteer tiers, demand measured on the engine,
calls served under the backbone's routing rule (``dispatched``) and under the best routing of a
placement (``routed``, a maximum flow), the linear-programming upper bound, decode speed.

Every function here is vectorised over experts and nodes (numpy arrays; no per-call objects).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from moeswarm import market as mk

GB = 1e9
BITS_PER_WEIGHT = 4  # experts stored at 4 bits (scales and zero points left out of the arithmetic)


@dataclass(frozen=True)
class Shape:
    """A MoE model as the swarm sees it: routed experts only (attention and dense parts stay on backbones)."""

    name: str
    layers: int  # MoE layers
    experts: int  # routed experts per MoE layer
    top_k: int  # experts each token calls per layer
    hidden: int  # hidden size: a call sends hidden values and gets as many back
    inter: int  # an expert's intermediate size (SwiGLU: 3 matrices hidden x inter)
    group: int = 1  # experts per simulated grid cell (adjacent experts of a layer move together)

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.inter

    @property
    def expert_bytes(self) -> int:
        return self.expert_params * BITS_PER_WEIGHT // 8

    @property
    def call_bytes(self) -> int:
        return 2 * self.hidden  # bf16 hidden state, each way

    def market(self) -> mk.ModelShape:
        """The market's grid; with ``group > 1`` one cell stands for ``group`` adjacent experts."""
        return mk.ModelShape(self.name, tuple(range(self.layers)), self.experts // self.group,
                             self.expert_bytes * self.group)

    def arithmetic(self) -> str:
        routed = self.layers * self.experts * self.expert_params
        return (f"{self.name}: {self.layers} MoE layers x {self.experts} experts x 3 x {self.hidden} x {self.inter} "
                f"= {routed / 1e9:,.0f}B routed parameters; {self.expert_bytes / 1e6:.1f} MB per expert at "
                f"{BITS_PER_WEIGHT} bits, {routed * BITS_PER_WEIGHT / 8 / 1e12:.2f} TB in all")


SHAPES = {
    "m3": Shape("minimax-m3", 57, 128, 4, 6144, 3072),
    "dsv3": Shape("deepseek-v3", 58, 256, 8, 7168, 2048),
    # 2T: 2.0e12 parameters, of which ~97% routed experts (DeepSeek-V3: 654B of 671B) = 1.94e12
    # over 64 x 512 experts = 5.9e7 each = 3 x 8192 x 2400; 29.5 MB at 4 bits, 0.97 TB in all
    "2t": Shape("swarm-2t", 64, 512, 8, 8192, 2400, group=8),
}


@dataclass(frozen=True)
class Tier:
    """A kind of volunteer. Links from seed 000 and the anchors; bandwidths in bytes/s."""

    name: str
    share: float  # of volunteers
    device_class: mk.DeviceClass
    memory_gb: tuple[float, float]  # memory given to expert weights (uniform range)
    flops: float  # sustained expert FLOP/s (a call costs 2 x expert params)
    mem_bps: float  # weight-streaming rate (the planner's compute_bps)
    down_bps: float
    up_bps: float
    rtt_s: tuple[float, float]  # round trip to the swarm's backbones (uniform range)
    diurnal: float  # amplitude of the daily online share (0: always on)


TIERS = (
    # hub: 200G-class link (25 GB/s each way), sub-ms; a datacenter GPU or a GB10-class box
    Tier("hub", 0.05, "hub", (64, 256), 2e14, 1e12, 25e9, 25e9, (0.0003, 0.001), 0.0),
    # home: seed 000's measured office link: 3.4 ms, 89 Mbit/s down, 49 Mbit/s up
    Tier("home", 0.35, "hub", (8, 32), 2e12, 5e10, 89e6 / 8, 49e6 / 8, (0.0034, 0.0034), 0.3),
    # phone behind the 443 relay: tens of ms, a few Mbit/s up
    Tier("phone", 0.60, "edge", (1, 4), 2e11, 2e10, 20e6 / 8, 3e6 / 8, (0.03, 0.08), 0.4),
)


def draw_tiers(rng: np.random.Generator, n: int) -> np.ndarray:
    shares = np.array([t.share for t in TIERS])
    return rng.choice(len(TIERS), size=n, p=shares / shares.sum())


def volunteers(rng: np.random.Generator, tiers: np.ndarray, shape: Shape, mem_scale: float) -> list[mk.Volunteer]:
    """A market ``Volunteer`` per tier index; ``throughput`` in calls/s of this model's experts: what
    it announces, the rate it measures serving, so its compute or its uplink, whichever is slower
    (a home box computes 17,700 M3 calls/s but its 49 Mbit/s uplink carries 500)."""
    out = []
    for t in tiers:
        tier = TIERS[t]
        mem = rng.uniform(*tier.memory_gb) * GB * mem_scale
        rate = min(tier.flops / (2 * shape.expert_params), tier.up_bps / shape.call_bytes)
        out.append(mk.Volunteer(int(mem), rate, tier.device_class,
                                tier.down_bps, float(rng.uniform(*tier.rtt_s)), upload_bytes_s=tier.up_bps))
    return out


# ---------------------------------------------------------------- demand


def measured_routing(tokens: int = 48) -> np.ndarray:
    """``(L, E)`` routed-call counts of the demo checkpoint, generating from a few prompts with the
    engine's own router (``Model.observers``): the trace the simulated demand is fitted to."""
    from moeswarm.demo import CHECKPOINT
    from moeswarm.model import SamplingParams, Tokenizer, generate, load_config, load_model

    cfg = load_config(CHECKPOINT)
    model = load_model(str(CHECKPOINT))
    counter = mk.DemandCounter([L for L in range(cfg.num_layers) if cfg.moe_layers[L]], cfg.num_experts)
    model.observers.append(counter.observe)
    tok = Tokenizer.from_folder(CHECKPOINT, cfg.bos_token_id)
    for prompt in ("And it came to pass", "The LORD is my shepherd", "In the beginning", "Blessed are the meek"):
        list(generate(model, tok.encode(prompt), SamplingParams(max_new_tokens=tokens)))
    return counter.snapshot()


def skew(shares: np.ndarray) -> float:
    """Coefficient of variation of a layer's expert shares (0: uniform), averaged over layers."""
    s = shares / shares.sum(axis=1, keepdims=True)
    return float((s.std(axis=1) / s.mean(axis=1)).mean())


def zipf_matching(cv: float, experts: int) -> float:
    """The Zipf exponent whose ``experts``-expert distribution has coefficient of variation ``cv``:
    the measured imbalance carried over to a wider layer (a router trained with a balance loss
    keeps its relative imbalance, not its top expert's share, as experts are added)."""
    lo, hi = 0.0, 4.0
    for _ in range(50):
        mid = (lo + hi) / 2
        p = np.arange(1, experts + 1) ** -mid
        if p.std() / p.mean() < cv:
            lo = mid
        else:
            hi = mid
    return lo


def zipf_grid(rng: np.random.Generator, layers: int, experts: int, s: float) -> np.ndarray:
    """Zipf(s) demand over each layer's experts in a fresh random order per layer; sums to 1."""
    base = np.arange(1, experts + 1) ** -s
    grid = np.stack([rng.permutation(base) for _ in range(layers)])
    out: np.ndarray = grid / grid.sum()
    return out


def grouped(grid: np.ndarray, group: int) -> np.ndarray:
    """Sum adjacent ``group`` experts of each layer into one cell."""
    L, E = grid.shape
    out: np.ndarray = grid.reshape(L, E // group, group).sum(axis=2)
    return out


# ---------------------------------------------------------------- serving


def routed(shape: mk.ModelShape, demand: np.ndarray, rects: np.ndarray, owner: np.ndarray,
           cap: np.ndarray) -> tuple[float, np.ndarray]:
    """Calls for each expert go to its holders, and a holder serves at most its rate; calls to
    experts nobody holds are lost. ``demand`` is calls/s per cell. Returns (served calls / all
    calls, calls/s served per node) under the routing that serves most with this placement: a
    maximum flow, calls -> expert -> holder (at most its rate) -> served.

    An upper bound on what any routing of the placement serves, the backbone's (``dispatched``)
    included. (An earlier model of the routing, multiplicative weights per holder, did not settle:
    on one M3 placement it served 72% after 20 rounds, 66% after 40 and 56% after 200, as a hub
    saturated by its only copies lost its weight on every expert it shares with slow holders.)
    """
    n_nodes = len(cap)
    if len(rects) == 0:
        return 0.0, np.zeros(n_nodes)
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import maximum_flow

    E = shape.grid[1]
    cells, holders = [], []
    for (r0, r1, e0, e1), n in zip(rects.tolist(), owner.tolist()):
        rr, ee = np.meshgrid(np.arange(r0, r1 + 1), np.arange(e0, e1 + 1), indexing="ij")
        cells.append((rr * E + ee).reshape(-1))
        holders.append(np.full(rr.size, n))
    cell, node = np.concatenate(cells), np.concatenate(holders)
    flat = demand.reshape(-1)
    scale = 1e8 / flat.sum()  # integer capacities (what maximum_flow takes): 1e8 units in all
    used = np.unique(cell)
    index = np.full(flat.size, -1)
    index[used] = np.arange(len(used))
    source, sink = 0, 1 + len(used) + n_nodes
    c_vertex, n_vertex = 1 + index[cell], 1 + len(used) + node
    want = np.floor(flat[used] * scale)
    limit = np.floor(np.minimum(cap * scale, 2**31 - 1))
    rows = np.concatenate([np.full(len(used), source), c_vertex, 1 + len(used) + np.arange(n_nodes)])
    cols = np.concatenate([1 + np.arange(len(used)), n_vertex, np.full(n_nodes, sink)])
    caps = np.concatenate([want, want[index[cell]], limit]).astype(np.int32)
    graph = csr_matrix((caps, (rows, cols)), shape=(sink + 1, sink + 1))
    flow = maximum_flow(graph, source, sink, method="dinic")
    per_node = np.asarray(flow.flow[1 + len(used):1 + len(used) + n_nodes, sink].todense()).reshape(-1) / scale
    return float(flow.flow_value / scale / flat.sum()), np.maximum(per_node, 0.0)


def _pairs(shape: mk.ModelShape, rects: np.ndarray, owner: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(flat cell, node) of every expert each node holds, once each."""
    E = shape.grid[1]
    cells, holders = [], []
    for (r0, r1, e0, e1), n in zip(rects.tolist(), owner.tolist()):
        rr, ee = np.meshgrid(np.arange(r0, r1 + 1), np.arange(e0, e1 + 1), indexing="ij")
        cells.append((rr * E + ee).reshape(-1))
        holders.append(np.full(rr.size, n))
    key = np.unique(np.concatenate(cells) * (int(owner.max()) + 1) + np.concatenate(holders))
    return key // (int(owner.max()) + 1), key % (int(owner.max()) + 1)


DISPATCH_ROUNDS = 12  # re-orderings by load (a holder's load only rises, so they settle within the node count)
SHARE_ROUNDS = 300  # fixed-point rounds for the shares saturated holders accept


def dispatched(shape: mk.ModelShape, demand: np.ndarray, rects: np.ndarray, owner: np.ndarray, cap: np.ndarray,
               rtt: np.ndarray) -> tuple[float, np.ndarray]:
    """Calls served under the backbone's own routing rule (``moeswarm.net.routing_table.plan_dispatch``
    via ``RemoteExperts._call_holders``), as a steady flow: (served calls / all calls, calls/s per node).

    The rule: each expert's calls go to the holder of lowest ``Holder.score()``, round trip x (1 +
    load_permille / 1000), ties to the lower peer id (here: node index). A holder computes at most
    its rate; more arriving fills its queue, so it announces load 1000 (the score doubles) and
    refuses calls with ``OVERLOADED`` at random among its arrivals, i.e. it serves the same share
    of every expert's calls sent to it; the backbone bans it for a while (``Holder.fail``) and its
    calls go to the next holder in score order, and so on down the expert's holders; what the last
    holder refuses is lost. Modelled: the round trip is the volunteer's (``Volunteer.rtt_s``); load
    is 0 below the rate and 1000 once a holder has been seen saturated (its queue stays near full
    while its arrivals sit at its rate; an order where it is idle again would give it the calls
    back). Left out: a dispatch's preference for a holder already chosen for another expert of the
    layer within 1.5x of the best score (``NEARLY_AS_GOOD``), queue time in the measured round
    trip, probation (``Verifier.plan``: every holder trusted), the three attempts per dispatch (a
    banned holder is skipped, not tried, so calls reach past the third holder).
    """
    n_nodes = len(cap)
    flat = demand.reshape(-1).astype(np.float64)
    if len(rects) == 0 or flat.sum() <= 0:
        return 0.0, np.zeros(n_nodes)
    cell, node = _pairs(shape, rects, owner)
    loaded = np.zeros(n_nodes, dtype=bool)
    for _ in range(DISPATCH_ROUNDS):
        score = rtt * (1.0 + loaded)
        order = np.lexsort((node, score[node], cell))  # by cell, then score, then peer
        c, n = cell[order], node[order]
        start = np.r_[0, np.flatnonzero(np.diff(c)) + 1]
        rank = np.arange(len(c)) - np.repeat(start, np.diff(np.r_[start, len(c)]))
        by_rank = np.argsort(rank, kind="stable")
        levels = np.split(by_rank, np.flatnonzero(np.diff(rank[by_rank])) + 1)  # the pairs k-th in their cell's order
        accept = np.ones(n_nodes)
        for _ in range(SHARE_ROUNDS):
            arrive, take = _cascade(flat, c, n, levels, accept)
            arrivals = np.bincount(n, arrive, minlength=n_nodes)
            new = np.minimum(1.0, cap / np.maximum(arrivals, 1e-300))
            settled = np.max(np.abs(new - accept)) < 1e-12
            accept = 0.5 * (accept + new)  # damped: a holder's share and those ahead of it move together
            if settled:
                break
        arrive, take = _cascade(flat, c, n, levels, accept)
        arrivals = np.bincount(n, arrive, minlength=n_nodes)
        now = loaded | (arrivals > cap * (1 + 1e-9))
        if np.array_equal(now, loaded):
            break
        loaded = now
    per_node = np.bincount(n, take, minlength=n_nodes)
    return float(take.sum() / flat.sum()), per_node


def _cascade(flat: np.ndarray, cell: np.ndarray, node: np.ndarray, levels: list[np.ndarray],
             accept: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each cell's calls down its holders in order (``levels[k]``: the pairs k-th in their cell):
    holder ``n`` takes ``accept[n]`` of what reaches it, the rest goes on. Returns (calls/s
    reaching, calls/s taken) per pair."""
    left = flat.copy()
    arrive, take = np.zeros(len(cell)), np.zeros(len(cell))
    for at in levels:
        arrive[at] = left[cell[at]]
        take[at] = arrive[at] * accept[node[at]]
        left[cell[at]] -= take[at]
    return arrive, take


def served_bound(demand: np.ndarray, rate: np.ndarray, slots: np.ndarray, *, step: float = 1.05) -> float:
    """An upper bound on the share of calls any placement and routing could serve (a linear program).

    The exact problem: node ``n`` holds at most ``slots_n`` experts (``y_ne`` in {0, 1}) and serves
    ``x_ne <= min(rate_n, d_e) * y_ne`` calls/s of expert ``e``, at most ``rate_n`` in all; expert
    ``e`` gets at most ``d_e``. Relaxed: ``y`` fractional, and nodes of similar rate (within
    ``step``) and experts of similar demand (within ``step``) merged into one variable each, with
    the group's largest rate and the bucket's largest demand: every real placement is feasible in
    the relaxation, so its optimum bounds them all. Blocks being rectangles is left out too.
    """
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix

    d = demand.reshape(-1)
    d = d[d > 0]
    cell_bin = np.floor(np.log(d / d.min()) / math.log(step)).astype(np.int64)
    _, cb = np.unique(cell_bin, return_inverse=True)
    nb = int(cb.max()) + 1
    n_cells = np.bincount(cb, minlength=nb).astype(np.float64)
    d_sum = np.bincount(cb, weights=d, minlength=nb)
    d_max = np.zeros(nb)
    np.maximum.at(d_max, cb, d)
    ok = rate > 0
    r, k = rate[ok], slots[ok].astype(np.float64)
    node_bin = np.floor(np.log(r / r.min()) / math.log(step)).astype(np.int64)
    _, gb = np.unique(node_bin, return_inverse=True)
    ng = int(gb.max()) + 1
    members = np.bincount(gb, minlength=ng).astype(np.float64)
    r_sum = np.bincount(gb, weights=r, minlength=ng)
    k_sum = np.bincount(gb, weights=k, minlength=ng)
    r_max = np.zeros(ng)
    np.maximum.at(r_max, gb, r)
    # variables: x[g, b] (calls/s) then y[g, b] (holdings); index g * nb + b
    nv = ng * nb
    g_idx, b_idx = np.divmod(np.arange(nv), nb)
    rows, cols, vals, rhs = [], [], [], []

    def add(row_of: np.ndarray, col: np.ndarray, val: np.ndarray) -> None:
        rows.append(row_of)
        cols.append(col)
        vals.append(val)

    base = 0
    add(base + np.arange(nv), np.arange(nv), np.ones(nv))  # x_gb - min(r_max, d_max) y_gb <= 0
    add(base + np.arange(nv), nv + np.arange(nv), -np.minimum(r_max[g_idx], d_max[b_idx]))
    rhs.append(np.zeros(nv))
    base += nv
    add(base + g_idx, np.arange(nv), np.ones(nv))  # sum_b x_gb <= r_sum_g
    rhs.append(r_sum)
    base += ng
    add(base + g_idx, nv + np.arange(nv), np.ones(nv))  # sum_b y_gb <= k_sum_g
    rhs.append(k_sum)
    base += ng
    add(base + b_idx, np.arange(nv), np.ones(nv))  # sum_g x_gb <= d_sum_b
    rhs.append(d_sum)
    base += nb
    a = coo_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(base, 2 * nv))
    upper = np.concatenate([np.full(nv, np.inf), members[g_idx] * n_cells[b_idx]])  # y_gb <= |g| |b|
    c = np.concatenate([-np.ones(nv), np.zeros(nv)])
    res = linprog(c, A_ub=a.tocsr(), b_ub=np.concatenate(rhs), bounds=np.column_stack([np.zeros(2 * nv), upper]),
                  method="highs")
    if res.status != 0:
        raise RuntimeError(f"bound LP failed: {res.message}")
    return float(-res.fun / d.sum())


# ---------------------------------------------------------------- decode speed (the tier planner's model)


def path_seconds(backbone: Tier, holder: Tier, holder_rtt: float, tokens: int, shape: Shape) -> float:
    """One expert call from a backbone of tier ``backbone`` to a holder: the planner's
    ``remote_seconds`` (round trip + hidden states up and down, each at its own bandwidth, + the
    holder streaming the expert's weights)."""
    from moeswarm.node.planner import ExpertSpec, Link, remote_seconds

    rtt = float(np.mean(backbone.rtt_s)) + holder_rtt
    link = Link(rtt, min(backbone.up_bps, holder.down_bps), min(holder.up_bps, backbone.down_bps), holder.mem_bps)
    return remote_seconds(ExpertSpec(0, 0, shape.expert_bytes), link, tokens, shape.call_bytes)


def decode_rates(rng: np.random.Generator, shape: Shape, demand: np.ndarray, cell_best: np.ndarray,
                 batches: tuple[int, ...], samples: int = 32) -> list[float]:
    """Tokens/s for each batch size: every MoE layer waits for its slowest call (calls of a layer
    run in parallel); ``cell_best[b]`` ``(L, cells)`` is the fastest holder's seconds per call at
    batch ``b`` (inf where nobody holds it). Token routes are drawn from ``demand``."""
    L, C = demand.shape
    cum = np.cumsum(demand / demand.sum(axis=1, keepdims=True), axis=1)
    out = []
    for b, batch in enumerate(batches):
        picks = batch * shape.top_k
        t = np.zeros(samples)
        for layer in range(L):
            cells = np.minimum(np.searchsorted(cum[layer], rng.random((samples, picks))), C - 1)  # (samples, picks)
            t += cell_best[b][layer][cells].max(axis=1)
        med = float(np.median(t))
        out.append(batch / med if math.isfinite(med) and med > 0 else 0.0)
    return out
