"""A flow network and its maximum flow (Dinic's algorithm): the minimum cuts the peak bounds are made of."""

from __future__ import annotations

from collections import deque

INF = 1 << 62  # an edge no finite cut crosses


class FlowNet:
    """A flow network with integer capacities; `max_flow` is Dinic's algorithm."""

    def __init__(self) -> None:
        self.adj: list[list[int]] = []
        self.to: list[int] = []
        self.cap: list[int] = []
        self.steps = 0  # per phase: the edges its search scans and its augmenting paths advance past; per path, its edges

    def node(self) -> int:
        self.adj.append([])
        return len(self.adj) - 1

    def edge(self, u: int, v: int, c: int) -> None:
        self.adj[u].append(len(self.to))
        self.to.append(v)
        self.cap.append(c)
        self.adj[v].append(len(self.to))
        self.to.append(u)
        self.cap.append(0)

    def max_flow(self, s: int, t: int) -> int:
        adj, to, cap = self.adj, self.to, self.cap
        flow = 0
        while True:
            level = [-1] * len(adj)
            level[s] = 0
            q = deque([s])
            while q:
                u = q.popleft()
                for e in adj[u]:
                    if cap[e] > 0 and level[to[e]] < 0:
                        level[to[e]] = level[u] + 1
                        q.append(to[e])
            self.steps += len(to)
            if level[t] < 0:
                return flow
            it = [0] * len(adj)
            while True:
                f = self._push(s, t, INF, level, it)
                if not f:
                    break
                flow += f
                if flow >= INF:
                    return INF
            self.steps += sum(it)

    def _push(self, s: int, t: int, limit: int, level: list[int], it: list[int]) -> int:
        """One augmenting path in the level graph (iterative DFS), its bottleneck pushed."""
        adj, to, cap = self.adj, self.to, self.cap
        path: list[int] = []  # edges
        u = s
        while True:
            if u == t:
                f = min(cap[e] for e in path)
                for e in path:
                    cap[e] -= f
                    cap[e ^ 1] += f
                self.steps += 2 * len(path)  # walked to the sink, then pushed along
                return f
            while it[u] < len(adj[u]):
                e = adj[u][it[u]]
                v = to[e]
                if cap[e] > 0 and level[v] == level[u] + 1:
                    break
                it[u] += 1
            else:
                if not path:
                    return 0
                level[u] = -1  # dead end
                e = path.pop()
                u = to[e ^ 1]
                it[u] += 1
                continue
            e = adj[u][it[u]]
            path.append(e)
            u = to[e]
