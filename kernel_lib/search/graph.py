"""The search graph and its policy: PUCT selection, progressive widening, root noise, backpropagation.

Nodes are variants (keyed by the hash of source and launch); edges are actions. Two paths reaching one variant
share its node, so it is evaluated once (a transposition); because moves can undo each other (a block size up,
then down), the graph has cycles, and selection never steps onto a node already on its path.

Selection walks from the root. At a node ``s`` it expands a new action while ``s`` has fewer children than
``PROG_WIDEN_K * N(s) ** PROG_WIDEN_ALPHA`` (progressive widening: a node earns breadth by being visited),
taking the untried action with the best score ``log P(s,a) + AMAF_BETA * gain(a)``, where ``gain(a)`` is the mean
log speedup the same action (same move and label) gave wherever it was tried in this run: what worked on one
node is tried early on others. Otherwise it descends to the child maximizing::

    Q(s,a) + PUCT_C * P(s,a) * sqrt(N(s)) / (1 + N(s,a))

where ``Q`` is the best reward found below the child, scaled to [0, 1] over all rewards seen (max-backup: we
want the fastest variant, not a good average). The root's priors get Dirichlet noise (``ROOT_NOISE_EPS``), so
seeds differ. Reward: ``log(baseline_ms / variant_ms)`` for a correct variant, ``FAIL_REWARD`` otherwise.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

PUCT_C = 1.0  # exploration weight against Q in [0, 1]
ROOT_NOISE_EPS = 0.25  # share of Dirichlet noise in the root's priors
ROOT_NOISE_ALPHA = 0.3  # Dirichlet concentration: < 1 puts the noise on a few actions
PROG_WIDEN_K = 1.5  # children allowed: K * N(s) ** ALPHA
PROG_WIDEN_ALPHA = 0.5
AMAF_BETA = 20.0  # weight of an action's mean gain elsewhere (log-speedup units) in the expansion order
FAIL_REWARD = -1.0  # a wrong or failed variant: worse than any correct one we expect


@dataclass
class Edge:
    key: str  # "move:label"
    move: str
    label: str
    prior: float
    child: str | None = None  # None until expanded
    visits: int = 0
    failed: str | None = None  # why expanding it gave no variant (a language-model reply that did not apply...)


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

    def set_edges(self, node: Node, actions: list[tuple[str, str, float]]) -> None:
        """Offer actions (move, label, prior) at ``node``; priors are normalized here."""
        total = sum(p for _, _, p in actions) or 1.0
        for move, label, prior in actions:
            key = f"{move}:{label}"
            node.edges.setdefault(key, Edge(key, move, label, prior / total))
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
        return math.log(max(edge.prior, 1e-9)) + AMAF_BETA * self.gain(edge.key) + self.rng.random() * 1e-6

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
                return path, None
            sqrt_n = math.sqrt(max(node.visits, 1))
            best = max(
                choices,
                key=lambda e: self._q(self.nodes[e.child]) + PUCT_C * e.prior * sqrt_n / (1 + e.visits),
            )
            best.visits += 1  # counted on the way down, so parallel selections spread out (a virtual visit)
            node = self.nodes[best.child]
            path.append(node.id)

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
    def record(self, node_id: str, reward: float, status: str, ms: float | None, parent: str | None, key: str | None):
        node = self.nodes[node_id]
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
        for nid, d in data["nodes"].items():
            node = Node(nid, d["depth"], list(d["parents"]), {}, d["expanded"], d["visits"], d["reward"], d["status"])
            node.best, node.ms = d["best"], d["ms"]
            for e in d["edges"]:
                node.edges[e["key"]] = Edge(
                    e["key"], e["move"], e["label"], e["prior"], e["child"], e["visits"], e.get("failed")
                )
            g.nodes[nid] = node
        return g


def _literal(text: str):
    import ast

    return ast.literal_eval(text)
