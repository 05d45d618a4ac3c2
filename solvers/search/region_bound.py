"""A peak bound over one backward region's orders and save/recompute choices, solved exactly.

Why: `peak_bound`'s families look at one backward op at a time (and the chained family at one op's operands).
A region such as a transformer MLP's backward needs several forward values live together somewhere: its gate,
up projection, activation and product, each made once (saved, or recomputed once) and read by several backward
ops in an order the plan chooses. No single op shows that; the region's orders do. On a Llama at a tight budget
the point bounds said 11.2 MiB where every plan found needed 15.7 (the MLP's four 2 MiB values live at once);
the regions say 14.45.

The argument, per region (`_Region`: recomputable forward ops `producers` near a seed backward op, the backward
ops `ops` that read their outputs, and the values `counted` below). Take any plan the simulator accepts; it
recomputes some subset S of the producers, each once, before every backward read of its outputs. Restricted to
the region, its steps are the region's backward ops and the recomputations of S, in an order consistent with the
dependencies (ancestors through any path, recomputations before their readers and after the recomputations they
read). At each such step these are live in that plan:

* at a region backward op b: what `peak_bound` counts at b whatever the plan does (inputs, held seeds, forward
  step outputs, b's operands less reuse, scratch: `_bw_const`), plus a minimum cut over everything else with the
  counted values left out (`_cut` with them skipped: a lower bound of what the plan keeps of the rest), plus
  each counted value whose copy spans b;
* at the recomputation of a producer P: inputs, held seeds and forward step outputs, P's operands and outputs
  (less the largest input it may write into), its scratch, and each counted value whose copy spans the step.

A counted value's copy spans a step when it exists before the step and a region step after it reads it: a
producer's output exists from the backward's start when saved (its forward copy) and from its recomputation
otherwise; a backward value made by a region op exists from that op; any other value the region reads at two
steps or more (one copy serves every backward read) exists from its first region read. A read outside the
region counts where it is certain to come later: at the region ops that are its reader's ancestors.

So each plan gives one S and one order whose largest step is at most the plan's peak; the least over every S
and order of that largest step is a lower bound. Each S also weighs its saved values outside the region (the
larger of the two is kept per S): a saved value's forward copy is live at every forward op after its producer,
while the caller computes its loss and at every backward op that runs before one of its readers, so it is added to
the forward bound at a few forward ops (`_forward` with it live), to the caller's (`_caller`) and to the point
bound at a few backward ops before the region (their cuts with every producer's output left out, the sum still a
lower bound); and held in a chain of other regions that run
before its readers, where it is live at each step that runs before a reader: the least over those regions' own
subsets, with their saved values held in the next region in turn (`_least_holding`). A value another region
holds is left out of that region's counted values and cuts, so nothing is counted twice.

The least over the orders is found per S by a minimax search over the sets of steps
done (each state the same whatever order led to it: what is live depends only on what ran), best-first, so only
states below the answer are expanded. Limits (deterministic, no clock): REGION_PRODUCERS recomputable producers
(2**n subsets), REGION_STEPS steps, REGION_STATES states per search, REGION_WORK states and REGION_EDGES cut edges
per problem; a search cut short makes no claim.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from ..model.problem import Phase, TensorKind

REGION_DEPTH = 3  # how far back from the seed's forward operands producers are followed
REGION_PRODUCERS = 6  # recomputable producers modeled per region (the nearest): 2**6 save/recompute subsets
REGION_STEPS = 20  # backward ops plus recomputations per region (beyond: the region is not bounded)
REGION_STATES = 20_000  # states one search may expand (beyond: no claim from that region)
REGION_WORK = 60_000  # states all regions of a problem may expand (about 1 s)
REGION_SEEDS = 4  # regions tried per problem, the most promising first
REGION_BEFORE = 3  # backward ops before the region (the highest upper bounds) where saved values are counted
REGION_EDGES = 300_000  # edges of the cut networks the regions may build
REGION_CROSSED = 2  # the strongest regions searched again with a chain of regions before them ...
REGION_CHAIN = 3  # ... this long (each region's saved values held in the next ones)


@dataclass
class _Region:
    seed: int  # the backward op it was built around
    producers: list[int]  # recomputable forward ops whose save/recompute choice is weighed
    ops: list[int]  # backward ops (the seed and every backward reader of a producer's output)
    counted: list[int]  # values whose copies the search follows


def region_bounds(b, consts: dict, upper: dict, found: dict, best: int) -> tuple[int, str]:
    """The largest region bound above `best` (and where), or (best, ""). `b`: peak_bound's `_Bound`;
    `consts`: per backward op, `_bw_const`; `upper`: per backward op, an upper bound of its point bound;
    `found`: point bounds computed so far (filled in here)."""
    p = b.p
    regions, covered = [], set()
    for seed in sorted(upper, key=lambda q: (-_operand_bytes(b, q), -q)):
        if seed not in covered and _claimable_operands(b, seed):
            region = _region(b, seed)
            if region is not None:
                covered.update(region.ops)
                regions.append(region)
    # the most promising first (the search's limits may stop before the last): the most bytes counted over the
    # largest constant part, then the latest in the program (the backward's last regions hold the most gradients)
    regions.sort(key=lambda r: (-sum(b.size[t] for t in r.counted) - max(consts[o][0] for o in r.ops), -max(r.ops)))
    where, start = "", best
    searches: list[tuple[int, _Search]] = []
    edge_end = b.work + REGION_EDGES
    for region in regions[:REGION_SEEDS]:
        if b.region_states >= REGION_WORK or b.work >= edge_end:
            break
        search = _Search(b, region, consts, upper, found)
        v = search.least(best)
        searches.append((v, search))
        if v > best:
            best, where = v, f"over the backward of {p.ops[region.seed].name}'s region"
    if best <= start:  # no region showed more than the points: their chains are not searched (the time they take)
        return best, where
    searches.sort(key=lambda vs: -vs[0])
    for v, a in searches[:REGION_CROSSED]:  # the strongest regions again, their saved values held in those before
        others = [s for _v, s in searches if s is not a]
        v = a.least(best, others) if others else 0
        if v > best:
            best, where = v, f"over the backward of {p.ops[a.r.seed].name}'s region and those before it"
    return best, where


def _claimable_operands(b, op_id: int) -> list[int]:
    return [t for t in dict.fromkeys(b.p.ops[op_id].inputs) if b.claimable(t)]


def _operand_bytes(b, op_id: int) -> int:
    return sum(b.size[t] for t in _claimable_operands(b, op_id))


def _region(b, seed: int) -> _Region | None:
    p = b.p
    producers: list[int] = []
    frontier = _claimable_operands(b, seed)
    for _depth in range(REGION_DEPTH):
        nxt = []
        for t in frontier:
            prod = p.tensors[t].producer
            if prod in producers or not b.recomputable[prod] or len(producers) >= REGION_PRODUCERS:
                continue
            producers.append(prod)
            nxt.extend(u for u in dict.fromkeys(p.ops[prod].inputs) if b.claimable(u))
        frontier = nxt
    if not producers:
        return None
    ops = {seed} | {r for q in producers for t in p.ops[q].outputs for r in b.readers[t] if p.ops[r].phase is Phase.BW}
    if len(ops) + len(producers) > REGION_STEPS:
        return None
    for _depth in range(REGION_DEPTH):  # the readers of what the region's ops make, while the steps allow
        more = ops | {r for o in ops for t in p.ops[o].outputs for r in b.readers[t]}
        if len(more) + len(producers) > REGION_STEPS:
            break
        ops = more
    ops = sorted(ops)
    reads: dict[int, int] = {}
    for o in ops:
        for t in dict.fromkeys(p.ops[o].inputs):
            reads[t] = reads.get(t, 0) + 1
    made = {t for q in producers for t in p.ops[q].outputs if b.claimable(t)}
    made |= {t for o in ops for t in p.ops[o].outputs if b.size[t] and reads.get(t)}
    shared = {t for t, n in reads.items() if n > 1 and b.size[t] and t not in b.input_ids
              and p.tensors[t].kind is not TensorKind.TANGENT and t not in b.fw_outputs and not b.offloadable[t]}
    return _Region(seed, producers, ops, sorted(made | shared))


_UNSET = 1 << 62


class _Search:
    """The minimax searches of one region, one per save/recompute subset of its producers."""

    def __init__(self, b, region: _Region, consts: dict, upper: dict, found: dict, exclude: frozenset = frozenset()):
        """`exclude`: values another region counts, left out of the cuts here too."""
        self.b, self.r, self.consts, self.upper, self.found, self.exclude = b, region, consts, upper, found, exclude
        p = b.p
        counted = set(region.counted) | exclude
        self.cut = {}
        for o in region.ops:  # the rest of each op's point bound, the counted values left to the search
            const, skip = consts[o]
            self.cut[o] = const + b._cut(p.ops[o], skip | counted)
        self.skips = {o: consts[o][1] for o in region.ops}
        self.producer_outputs = {t for q in region.producers for t in p.ops[q].outputs}
        self.claimed = frozenset(t for t in self.producer_outputs if b.claimable(t))
        self.readers = {r for t in self.claimed for r in b.readers[t] if p.ops[r].phase is Phase.BW}
        in_region = set(region.ops)
        before = {q for q in upper if q not in in_region and any(b.anc[o] >> q & 1 for o in region.ops)}
        for q in sorted(before, key=lambda q: (-upper[q], q))[:REGION_BEFORE * 3]:
            if q not in found:
                found[q] = consts[q][0] + b._cut(p.ops[q], consts[q][1])
        self.before = sorted((q for q in before if q in found), key=lambda q: (-found[q], q))[:REGION_BEFORE]
        made_after = [q.id for q in p.fw_ops if any(b.anc[q.id] >> r & 1 for r in region.producers)]
        self.fw_points = sorted(made_after, key=lambda q: (-b.fw_values.get(q, 0), q))[:REGION_BEFORE]
        self.fw_points += [q for q in made_after[-1:] if q not in self.fw_points]  # the forward's end
        self.forced: dict = {}
        # what no subset changes (the region's ops are its first steps, in this order, in every search): which ops
        # run before which, which run before a counted value's reader outside the region, each op's own cost
        self.op_before = [sum(1 << j for j, o2 in enumerate(region.ops) if b.anc[o] >> o2 & 1) for o in region.ops]
        self.later = {}
        for t in region.counted:
            outside = [x for x in b.readers[t] if x not in in_region and p.ops[x].phase is Phase.BW]
            self.later[t] = sum(1 << i for i, o in enumerate(region.ops) if any(b.anc[x] >> o & 1 for x in outside))
        self.subsets = [[q for i, q in enumerate(region.producers) if m >> i & 1]  # everything recomputed first
                        for m in sorted(range(1 << len(region.producers)), key=lambda m: (-bin(m).count("1"), m))]

    def least(self, best: int, others: list[_Search] = ()) -> int:
        """The least, over the subsets, of the least largest step; `best` or less as soon as one subset gets
        there (the region cannot raise the bound then). 0: no claim (a search ran out of states). `others`:
        regions that may run before this one's readers: a chain of them (each the strongest of `others` running
        before a reader of the previous one's producers) holds a subset's saved values, whose own saved values
        join them in the next."""
        chain, prev, claimed = [], self, self.claimed
        while others and len(chain) < REGION_CHAIN:
            before = [o for o in others if not o.claimed & claimed
                      and any(self.b.anc[r] >> q & 1 for q in o.r.ops for r in prev.readers)]
            if not before:
                break
            nxt = max(before, key=lambda o: sum(self.b.size[t] for t in o.claimed))  # the most it could save
            chain.append(_Search(self.b, nxt.r, self.consts, self.upper, self.found, exclude=claimed))
            prev, claimed = nxt, claimed | nxt.claimed
            others = [o for o in others if o is not nxt]
        least = self._least_holding(frozenset(), best, _UNSET, chain)
        return 0 if least >= _UNSET else least

    def _least_holding(self, held: frozenset, enough: int, stop: int, chain: list[_Search] = ()) -> int:
        """The least over this region's subsets with `held` (earlier regions' saved values) live wherever a
        reader of theirs runs later, and `chain`'s regions holding these and this subset's saved values:
        `enough` or less once one subset gets there, `stop` or more when none gets below it (0: no claim)."""
        least = stop
        for recomputed in self.subsets:
            v = self._saved_before(recomputed, held)
            if v >= least:
                continue
            found = self._search(recomputed, least, held)
            if found is None:
                return 0
            v = max(v, found)
            if chain and v < least:
                nxt = chain[0]
                saved = self.claimed - {t for q in recomputed for t in self.b.p.ops[q].outputs}
                more = (held | saved) - nxt.claimed - set(nxt.r.counted)
                if more:
                    v = max(v, nxt._least_holding(more, v, least, chain[1:]))
            least = min(least, v)
            if least <= enough:
                break
        return least

    def _saved_before(self, recomputed: list[int], held: frozenset = frozenset()) -> int:
        """The largest bound at the ops before the region with the saved producers' outputs (and `held`, earlier
        regions' saved values) live there: a saved value's forward copy lasts from its producer to its backward
        reads, live at every forward op after the producer, while the caller computes its loss, and at every
        backward op that runs before a reader."""
        b, p = self.b, self.b.p
        saved = [t for q in self.r.producers if q not in recomputed for t in p.ops[q].outputs if b.claimable(t)]
        saved = [t for t in (*saved, *held) if any(p.ops[r].phase is Phase.BW for r in b.readers[t])]
        most = 0
        if saved and b.has_backward:  # the caller's loss, between the forward and the backward
            key = ("caller", frozenset(saved))
            if key not in self.forced:
                self.forced[key] = b._caller(key[1])
            most = self.forced[key]
        for f in self.fw_points:
            live = frozenset(t for t in saved if b.anc[f] >> p.tensors[t].producer & 1)
            if live:
                key = (f, live)
                if key not in self.forced:
                    self.forced[key] = b._forward(p.ops[f], live)
                most = max(most, self.forced[key])
        for q in self.before:
            skip = self.consts[q][1]
            most = max(most, self._before_base(q) + sum(b.size[t] for t in saved if t not in skip
                                                        and any(b.anc[r] >> q & 1 for r in b.readers[t])))
        return most

    def _before_base(self, q: int) -> int:
        """The point bound at `q` with every producer's output (and earlier regions') left out of its cut, counted
        on top when saved: a cut with more values left out is no larger, so the sum stays a lower bound."""
        if q not in self.forced:
            const, skip = self.consts[q]
            self.forced[q] = const + self.b._cut(self.b.p.ops[q], skip | self.claimed | self.exclude)
        return self.forced[q]

    def _search(self, recomputed: list[int], stop: int, held: frozenset = frozenset()) -> int | None:
        """The least largest step over the orders with `recomputed` recomputed; `stop` or more once every order
        reaches `stop` (None: no claim, out of states). `held`: forward copies live at each step that runs
        before one of their backward readers."""
        b, p, r = self.b, self.b.p, self.r
        steps = [("op", o) for o in r.ops] + [("rc", q) for q in recomputed]
        index = {s: i for i, s in enumerate(steps)}
        rc_of = {q: index[("rc", q)] for q in recomputed}
        op_steps = {o: index[("op", o)] for o in r.ops}
        made_by = {t: rc_of[q] for q in recomputed for t in p.ops[q].outputs}
        made_by.update({t: op_steps[o] for o in r.ops for t in p.ops[o].outputs})
        before = self.op_before + [0] * len(recomputed)  # steps that must run first
        for o, i in op_steps.items():
            for t in p.ops[o].inputs:
                if t in made_by and made_by[t] != i:
                    before[i] |= 1 << made_by[t]
        for q, i in rc_of.items():
            for t in p.ops[q].inputs:
                if t in made_by and p.tensors[t].producer in rc_of:
                    before[i] |= 1 << made_by[t]
        readers = {t: 0 for t in r.counted}  # per counted value: the region steps that read it
        for i, (_kind, o) in enumerate(steps):
            for t in p.ops[o].inputs:
                if t in readers:
                    readers[t] |= 1 << i
        later = self.later
        starts = {}  # per counted value: the steps after which it exists (0: from the backward's start)
        for t in r.counted:
            if t in made_by:
                starts[t] = 1 << made_by[t]
            elif b.fw_made[t] and (p.tensors[t].producer not in rc_of) and t in self.producer_outputs:
                starts[t] = 0
            else:
                starts[t] = readers[t]  # exists from its first region read
        costs = [self._step_cost(kind, o) for kind, o in steps]
        if held:
            costs = [(base + self._held_at(kind, o, own, held), own) for (base, own), (kind, o) in zip(costs, steps)]
        full = (1 << len(steps)) - 1
        seen = {0: 0}
        heap = [(0, 0)]
        while heap:
            v, done = heapq.heappop(heap)
            if done == full or v >= stop:
                return v
            if seen.get(done, -1) < v:
                continue
            b.region_states += 1
            if b.region_states > REGION_WORK or len(seen) > REGION_STATES:
                return None
            for i in range(len(steps)):
                if done >> i & 1 or before[i] & ~done:
                    continue
                base, own = costs[i]
                after = done | 1 << i
                live = sum(b.size[t] for t in r.counted if t not in own and (starts[t] == 0 or starts[t] & done)
                           and (readers[t] & ~after or later[t] & ~done))
                w = max(v, base + live)
                if w < seen.get(after, w + 1):
                    seen[after] = w
                    heapq.heappush(heap, (w, after))
        return None

    def _held_at(self, kind: str, o: int, own: set[int], held: frozenset) -> int:
        """Bytes of `held` live at the step: it runs before a backward reader (its own operands are counted)."""
        b, p = self.b, self.b.p
        if kind == "op":
            first = [o]
        else:  # a recomputation runs before the region's readers of its outputs
            first = [r for t in p.ops[o].outputs for r in b.readers[t] if r in self.skips]
        return sum(b.size[t] for t in held if t not in own
                   and any(b.anc[r] >> f & 1 or r == f for r in b.readers[t] for f in first))

    def _step_cost(self, kind: str, o: int) -> tuple[int, set[int]]:
        """(what the step holds besides the counted values that span it, the values that part counts)."""
        b, p = self.b, self.b.p
        if kind == "op":
            return self.cut[o], self.skips[o]
        op = p.ops[o]
        own = {t for t in (*op.inputs, *op.outputs) if t not in b.input_ids and t not in b.fw_outputs
               and p.tensors[t].kind is not TensorKind.TANGENT}
        if op.reuse_all:
            shared = sum(b.size[i] for _o, i in op.reuse)
        else:
            shared = max((b.size[i] for _o, i in op.reuse), default=0)
        return b.backward_const + max(0, sum(b.size[t] for t in own) - shared) + b.ws[o], own
