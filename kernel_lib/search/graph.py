"""The search graph and its policy: PUCT selection, progressive widening, root noise, backpropagation.

Nodes are variants (keyed by the hash of source and launch); edges are actions. Two paths reaching one variant
share its node, so it is evaluated once (a transposition); because moves can undo each other (a block size up,
then down), the graph has cycles, and selection never steps onto a node already on its path.

Selection walks from the root. At a node ``s`` it expands a new action while ``s`` has fewer children than
``PROG_WIDEN_K * N(s) ** PROG_WIDEN_ALPHA`` (progressive widening: a node earns breadth by being visited),
taking the untried action with the best score ``log P(s,a) + SURROGATE_BETA * predicted(a)``: ``predicted`` is
the reward a ridge regression over knob values and their pairs (``Surrogate``), fitted on every evaluation so far,
expects of the child. What one branch learned about ``BLOCK_N=256`` with 8 warps ranks untried actions everywhere.
Otherwise it descends to the child maximizing::

    Q(s,a) + PUCT_C * P(s,a) * sqrt(N(s)) / (1 + N(s,a))

where ``Q`` is the best reward found below the child, scaled to [0, 1] over all rewards seen (max-backup: we
want the fastest variant, not a good average). The root's priors get Dirichlet noise (``ROOT_NOISE_EPS``), so
seeds differ. Reward: ``log(baseline_ms / variant_ms)`` for a correct variant, ``FAIL_REWARD`` otherwise.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

# Chosen on the H100 tables of benchmarks/search_spaces (seeds 0-4), checked on seeds 10-19: see NOTES.md.
PUCT_C = 0.5  # exploration weight against Q in [0, 1]
ROOT_NOISE_EPS = 0.25  # share of Dirichlet noise in the root's priors
ROOT_NOISE_ALPHA = 0.3  # Dirichlet concentration: < 1 puts the noise on a few actions
PROG_WIDEN_K = 1.0  # children allowed: K * N(s) ** ALPHA
PROG_WIDEN_ALPHA = 0.3
AMAF_BETA = 0.0  # weight of the action's mean gain elsewhere in the order (0 since the surrogate: it ranks better)
PRIOR_SPLIT = 0.5  # an action's prior: its move's prior / (actions of that move here) ** PRIOR_SPLIT
FAIL_REWARD = -1.0  # a wrong or failed variant: worse than any correct one we expect
SURROGATE_BETA = 10.0  # weight of the surrogate's predicted reward (log-speedup units) in the expansion order
SURROGATE_RIDGE = 1.0  # ridge penalty: an unseen knob value predicts no change
SURROGATE_PAIR_RIDGE = 3.0  # pairs are many and each seen rarely: shrunk harder
SURROGATE_NOVELTY = 0.05  # optimism per knob value never measured (log-speedup units)


@dataclass
class Edge:
    key: str  # "move:label"
    move: str
    label: str
    prior: float
    child: str | None = None  # None until expanded
    visits: int = 0
    failed: str | None = None  # why expanding it gave no variant (a language-model reply that did not apply...)
    features: list[str] = field(default_factory=list)  # the child's knob values, for the surrogate model


@dataclass
class Node:
    id: str
    depth: int
    parents: list[str] = field(default_factory=list)
    edges: dict[str, Edge] = field(default_factory=dict)  # every action offered here, tried or not
    expanded: bool = False  # edges generated
    visits: int = 0
    reward: float | None = None  # None: not evaluated yet (or in flight)
    status: str = "new"  # new, pending, ok, or a failure status
    best: float | None = None  # best reward at or below this node
    ms: float | None = None

    def children(self) -> list[Edge]:
        return [e for e in self.edges.values() if e.child is not None]

    def untried(self) -> list[Edge]:
        return [e for e in self.edges.values() if e.child is None and e.failed is None]


class Graph:
    def __init__(self, seed: int = 0):
        self.nodes: dict[str, Node] = {}
        self.root: str | None = None
        self.rng = random.Random(seed)
        self.action_gain: dict[str, list[float]] = {}  # action key -> [count, sum of log speedups over parent]
        self.rewards: list[float] = []
        self.noise_applied = False
        self.surrogate = Surrogate()

    # ---------------------------------------------------------------- building
    def add_node(self, node_id: str, parent: str | None, depth: int) -> tuple[Node, bool]:
        """The node for ``node_id``, and whether it is new (False: a transposition)."""
        if node_id in self.nodes:
            node = self.nodes[node_id]
            if parent is not None and parent not in node.parents:
                node.parents.append(parent)
            return node, False
        node = Node(node_id, depth, [parent] if parent else [])
        self.nodes[node_id] = node
        if self.root is None:
            self.root = node_id
        return node, True

    def lineage(self, node_id: str) -> list[str]:
        """How ``node_id`` was first derived: the root, then each node's first parent down to it (its depth + 1
        ids). The selection walk that reached it can be far longer (transpositions, a resumed run's detours)."""
        chain, seen = [node_id], {node_id}
        while self.nodes[chain[0]].parents:
            parent = self.nodes[chain[0]].parents[0]
            if parent in seen or parent not in self.nodes:
                break
            seen.add(parent)
            chain.insert(0, parent)
        return chain

    def set_edges(self, node: Node, actions: list[tuple]) -> None:
        """Offer actions (move, label, prior, child features) at ``node``; priors are normalized here."""
        total = sum(a[2] for a in actions) or 1.0
        for move, label, prior, features in actions:
            key = f"{move}:{label}"
            node.edges.setdefault(key, Edge(key, move, label, prior / total, features=list(features)))
        node.expanded = True
        if node.id == self.root and not self.noise_applied and node.edges:
            self._root_noise(node)

    def _root_noise(self, node: Node) -> None:
        edges = list(node.edges.values())
        noise = [self.rng.gammavariate(ROOT_NOISE_ALPHA, 1.0) for _ in edges]
        total = sum(noise) or 1.0
        for e, n in zip(edges, noise, strict=True):
            e.prior = (1 - ROOT_NOISE_EPS) * e.prior + ROOT_NOISE_EPS * n / total
        self.noise_applied = True

    # ---------------------------------------------------------------- selection
    def _q(self, node: Node) -> float:
        if node.best is None:
            return 0.0
        lo, hi = min(self.rewards), max(self.rewards)
        return 0.5 if hi <= lo else (node.best - lo) / (hi - lo)

    def gain(self, key: str) -> float:
        """Mean log speedup of this action over its parents so far, shrunk toward 0 by one pseudo-observation."""
        count, total = self.action_gain.get(key, (0, 0.0))
        return total / (count + 1)

    def expansion_score(self, edge: Edge) -> float:
        predicted = self.surrogate.predict(edge.features) if edge.features else 0.0
        return (
            math.log(max(edge.prior, 1e-9))
            + AMAF_BETA * self.gain(edge.key)
            + SURROGATE_BETA * predicted
            + self.rng.random() * 1e-6
        )

    def select(self, blocked: set[str], skip_edge) -> tuple[list[str], Edge | None]:
        """Walk from the root; return the path and the edge to expand there (None: nothing left to expand).

        ``blocked``: nodes that cannot be stepped on (in flight); ``skip_edge(edge)`` hides untried edges (pruned).
        """
        path = [self.root]
        node = self.nodes[self.root]
        while True:
            untried = [e for e in node.untried() if not skip_edge(e)]
            limit = PROG_WIDEN_K * max(node.visits, 1) ** PROG_WIDEN_ALPHA
            choices = [
                e for e in node.children() if e.child not in path and e.child not in blocked and self.open(e.child)
            ]
            if untried and (len(node.children()) < limit or not choices):
                return path, max(untried, key=self.expansion_score)
            if not choices:
                pruned = node.untried()  # nothing else left here: a pruned action is better than stopping
                if pruned:
                    return path, max(pruned, key=self.expansion_score)
                return self._anywhere(blocked)
            sqrt_n = math.sqrt(max(node.visits, 1))
            best = max(
                choices,
                key=lambda e: self._q(self.nodes[e.child]) + PUCT_C * e.prior * sqrt_n / (1 + e.visits),
            )
            best.visits += 1  # counted on the way down, so parallel selections spread out (a virtual visit)
            node = self.nodes[best.child]
            path.append(node.id)

    def _anywhere(self, blocked: set[str]) -> tuple[list[str], Edge | None]:
        """The walk ended where cycles close every way on: expand at the best node that still has actions."""
        candidates = [n for n in self.nodes.values() if n.status == "ok" and n.id not in blocked and n.untried()]
        if not candidates:
            return [self.root], None
        node = max(candidates, key=lambda n: (n.best if n.best is not None else -math.inf, -n.depth))
        path, seen = [node.id], {node.id}
        while path[0] != self.root:  # back to the root through first parents, for backpropagation
            parent = next((p for p in self.nodes[path[0]].parents if p not in seen), None)
            if parent is None:
                break
            seen.add(parent)
            path.insert(0, parent)
        return path, max(node.untried(), key=self.expansion_score)

    def open(self, node_id: str, _seen: set | None = None) -> bool:
        """Whether anything is left to expand at or below this node (cycles cut)."""
        node = self.nodes[node_id]
        if node.status not in ("ok",):
            return False  # failed or pending variants are not expanded
        if not node.expanded or node.untried():
            return True
        seen = _seen if _seen is not None else set()
        if node_id in seen:
            return False
        seen.add(node_id)
        return any(self.open(e.child, seen) for e in node.children())

    # ---------------------------------------------------------------- backpropagation
    def record(
        self, node_id: str, reward: float, status: str, ms: float | None, parent: str | None, key: str | None,
        features: list[str] | None = None,
    ):  # fmt: skip
        node = self.nodes[node_id]
        if features:
            self.surrogate.add(features, reward)
        node.reward, node.status, node.ms = reward, status, ms
        node.best = reward if node.best is None else max(node.best, reward)
        self.rewards.append(reward)
        if parent is not None and key is not None and status == "ok":
            parent_reward = self.nodes[parent].reward
            if parent_reward is not None:
                count, total = self.action_gain.get(key, (0, 0.0))
                self.action_gain[key] = [count + 1, total + (reward - parent_reward)]

    def backpropagate(self, path: list[str], value: float) -> None:
        for node_id in path:
            node = self.nodes[node_id]
            node.visits += 1
            node.best = value if node.best is None else max(node.best, value)

    def incumbent(self) -> Node | None:
        ok = [n for n in self.nodes.values() if n.status == "ok" and n.reward is not None]
        return max(ok, key=lambda n: n.reward) if ok else None

    # ---------------------------------------------------------------- persistence
    def to_dict(self) -> dict:
        return {
            "root": self.root,
            "rng_state": repr(self.rng.getstate()),
            "action_gain": self.action_gain,
            "rewards": self.rewards,
            "noise_applied": self.noise_applied,
            "surrogate": self.surrogate.rows,
            "nodes": {
                nid: {
                    "depth": n.depth,
                    "parents": n.parents,
                    "expanded": n.expanded,
                    "visits": n.visits,
                    "reward": n.reward,
                    "status": n.status,
                    "best": n.best,
                    "ms": n.ms,
                    "edges": [
                        {
                            "key": e.key,
                            "move": e.move,
                            "label": e.label,
                            "prior": e.prior,
                            "child": e.child,
                            "visits": e.visits,
                            "failed": e.failed,
                            "features": e.features,
                        }
                        for e in n.edges.values()
                    ],
                }  # fmt: skip
                for nid, n in self.nodes.items()
            },
        }

    @staticmethod
    def from_dict(data: dict, seed: int = 0) -> Graph:
        g = Graph(seed)
        g.root = data["root"]
        g.rng.setstate(_literal(data["rng_state"]))
        g.action_gain = {k: list(v) for k, v in data["action_gain"].items()}
        g.rewards = list(data["rewards"])
        g.noise_applied = data["noise_applied"]
        g.surrogate.rows = [(list(f), float(r)) for f, r in data.get("surrogate", [])]
        for nid, d in data["nodes"].items():
            node = Node(nid, d["depth"], list(d["parents"]), {}, d["expanded"], d["visits"], d["reward"], d["status"])
            node.best, node.ms = d["best"], d["ms"]
            for e in d["edges"]:
                node.edges[e["key"]] = Edge(
                    e["key"],
                    e["move"],
                    e["label"],
                    e["prior"],
                    e["child"],
                    e["visits"],
                    e.get("failed"),
                    e.get("features", []),
                )
            g.nodes[nid] = node
        return g


class Surrogate:
    """Reward as a sum of one effect per knob value (``BLOCK_N=256``, ``num_warps=8``, ``source=<hash>``), fitted by
    ridge regression on every evaluated variant. Effects of block sizes and warps are roughly additive in log time,
    so what one branch learned about ``BLOCK_N=256`` ranks untried actions everywhere; a value never measured gets
    a small optimism bonus, so each is tried."""

    def __init__(self):
        self.rows: list[tuple[list[str], float]] = []
        self._weights: dict[str, float] | None = None

    def add(self, features: list[str], reward: float) -> None:
        self.rows.append((_with_pairs(features), reward))
        self._weights = None

    def _fit(self) -> dict[str, float]:
        import numpy as np

        names = sorted({f for fs, _ in self.rows for f in fs})
        index = {n: i for i, n in enumerate(names)}
        x = np.zeros((len(self.rows), len(names) + 1))
        y = np.array([r for _, r in self.rows])
        for i, (fs, _) in enumerate(self.rows):
            x[i, -1] = 1.0
            for f in fs:
                x[i, index[f]] = 1.0
        ridge = [SURROGATE_PAIR_RIDGE if "&" in n else SURROGATE_RIDGE for n in names]
        penalty = np.diag(ridge + [1e-6])  # the intercept is not shrunk
        w = np.linalg.solve(x.T @ x + penalty, x.T @ y)
        return {**{n: float(w[i]) for n, i in index.items()}, "": float(w[-1])}

    def predict(self, features: list[str]) -> float:
        if not self.rows:
            return 0.0
        if self._weights is None:
            self._weights = self._fit()
        w = self._weights
        return w[""] + sum(w.get(f, 0.0 if "&" in f else SURROGATE_NOVELTY) for f in _with_pairs(features))


def _with_pairs(features: list[str]) -> list[str]:
    """Knob values and their pairs (``BLOCK_N=256&num_warps=4``): a big tile is good with enough warps only."""
    knobs = sorted(f for f in features if not f.startswith("source="))
    return list(features) + [f"{a}&{b}" for i, a in enumerate(knobs) for b in knobs[i + 1 :]]


def _literal(text: str):
    import ast

    return ast.literal_eval(text)
