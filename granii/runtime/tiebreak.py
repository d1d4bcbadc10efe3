"""The measured tie-break among close candidates (``Trial``), the backward clock that times a
training call's backward, and how turns on graphs of different sizes compare."""
import time
from dataclasses import dataclass, field

import torch

from ..device import synchronize
from .state import ORIGINAL, _INSPECTING


TRIAL_ROUNDS = 3         # timed calls per candidate, after one untimed call each
TRIAL_DROP = 1.5         # a candidate whose fastest timed call is this much slower is dropped
TRIAL_DROP_ONE = 2.0     # ... on sampled blocks, while a candidate has only one timed call
TRIAL_FIRST_DROP = 4.0   # ... or whose untimed first call is this much slower than a timed one
TRIAL_FIRST_EXCESS = 0.001  # ... and by this many seconds (beyond timer noise)
ORIGINAL_MARGIN = 0.05   # a plan is kept over the layer's own forward when this much faster
PLAN_MARGIN = 0.05       # ... and over the plan the cost model ranked first when this much faster
TRIAL_CLOSE = 0.15       # the fastest and the model's first choice, this close, ...
TRIAL_MORE_ROUNDS = 7    # ... take this many timed calls each before one is kept (whole graphs)
TRIAL_DROP_FAR = 3.0     # a candidate this much slower leaves after one timed call


@dataclass
class Trial:
    """A measured tie-break (like cuDNN's benchmark mode): the best predicted plan, the next one
    when predicted within ``TRIAL_MARGIN`` of it, the best plan with another implementation of a
    graph kernel when predicted within that margin too (``select.trial_candidates``), and the
    layer's original forward take turns on the first calls of a decision (each call returns the
    same result); after one untimed and ``TRIAL_ROUNDS`` timed calls each, the one with the
    fastest median time is kept: the forward, and in training the forward and the layer's
    backward (``BackwardClock``), recorded when the next call comes.
    So a wrong prediction costs at most those calls, and granii is never kept slower than DGL's
    own layer as measured. A candidate whose fastest timed call is more than ``TRIAL_DROP``
    times the fastest timed call of another leaves the trial at once (``drop_slow``): a plan
    priced far too low (a per-head plan predicted at 43 ms ran 160 ms in training on a PubMed
    block) then costs two calls, not four (on sampled blocks, one when ``TRIAL_DROP_ONE`` times
    slower). The layer's own forward, when its untimed first call alone exceeds
    ``TRIAL_FIRST_DROP`` times another's fastest timed call, and by ``TRIAL_FIRST_EXCESS``
    seconds, leaves before its timed call (a plan does not: its first call does its one-time
    work, ``drop_slow``): DGL's GATConv on GitHub at 32 -> 128, 53 ms a call
    beside a 4 ms plan, then runs once, not twice (its second call was a tenth of the first 100
    calls' time). The factor leaves room for a first call's warm-up (DGL's first call on a graph
    builds its sparse formats): across the 162 single-layer configurations of the benchmark,
    DGL's first call on a new graph took at most 3.05x its later calls (GraphConv, GitHub,
    32 -> 32), so the layer's own forward is not dropped for a slow first call when it would
    have been the fastest.

    On sampled blocks the candidates take turns on successive blocks of one sampler
    configuration, whose sizes differ: each time is divided by the block's size
    ``E + N_src + N_dst`` (``block_scale``), so the medians compare time per unit of work; the
    kept decision then serves the later blocks (``homes``: where it is stored besides the block's
    own table). There no call is left untimed (``warm=0``): the first call on a graph builds
    what later calls on it reuse, and on blocks used once every call does that, so a candidate's
    first call is one of its ``TRIAL_ROUNDS``; the trial then costs a call less per candidate."""
    candidates: list
    warm: int = 1                                 # untimed first calls per candidate
    times: dict = field(default_factory=dict)
    turn: int = 0
    homes: list = field(default_factory=list)     # [(dict, key)] that get the kept decision
    pending: list = field(default_factory=list)   # [(label, forward seconds, BackwardClock)]
    dropped: list = field(default_factory=list)   # candidates ``drop_slow`` took out
    predicted: str = None                         # the label the cost model ranked first

    def __post_init__(self):
        if self.predicted is None and self.candidates:
            self.predicted = self.candidates[0][0]

    def next(self):
        if _INSPECTING[0]:           # ``granii(...)``'s own run is no turn: the predicted best
            return self.candidates[0]
        c = self.candidates[self.turn % len(self.candidates)]
        self.turn += 1
        return c

    def record(self, label, seconds):
        if not _INSPECTING[0]:
            self.times.setdefault(label, []).append(seconds)

    def await_backward(self, label, seconds, clock):
        """Record this call (``seconds`` of forward) when its backward has run (``collect``);
        not the calls of ``granii(...)``'s own run, which no backward follows."""
        if _INSPECTING[0]:
            clock.remove()
        else:
            self.pending.append((label, seconds, clock))

    def collect(self):
        """Record the calls whose backward was awaited: forward + backward seconds (the
        forward alone when no backward ran)."""
        for label, forward, clock in self.pending:
            clock.remove()
            self.record(label, forward + (clock.seconds() or 0.0))
        self.pending.clear()

    def settled(self):
        """Every candidate has its ``TRIAL_ROUNDS`` timed calls. On whole graphs, when the
        fastest median is not the plan the cost model ranked first but lies within
        ``TRIAL_CLOSE`` of it, those two go on to ``TRIAL_MORE_ROUNDS`` (the others leave)
        before the measurement overrules the model: on a small layer a call's time varies by a
        fifth from call to call (measured on DGL's GIN example, where the first three calls of
        plans that differ by a tenth in steady state ranked them either way), and the median of
        three cannot tell them apart. Where the model's choice measures fastest, or far from
        fastest, three are enough. On sampled blocks each turn is another block, and the turns
        stay as few as they are."""
        if not all(len(self.times.get(c[0], ())) >= self.warm + TRIAL_ROUNDS
                   for c in self.candidates):
            return False
        if self.warm == 0 or len(self.candidates) < 2:
            return True
        med = self.medians()
        best = min(self.candidates, key=lambda c: med[c[0]])
        first = next((c for c in self.candidates if c[0] == self.predicted), None)
        if first is None or best is first or med[first[0]] > (1 + TRIAL_CLOSE) * med[best[0]]:
            return True
        self.dropped += [c for c in self.candidates if c is not best and c is not first]
        self.candidates = [c for c in self.candidates if c is best or c is first]
        return all(len(self.times.get(c[0], ())) >= self.warm + TRIAL_MORE_ROUNDS
                   for c in self.candidates)

    def done(self):
        """Every candidate timed enough, or one left (the others raised or were dropped)."""
        return self.settled() or len(self.candidates) == 1

    def close(self):
        """Forget the calls whose backward was awaited: their hooks leave the parameters."""
        for _, _, clock in self.pending:
            clock.remove()
        self.pending.clear()

    def drop_slow(self):
        """Take out the candidates whose fastest timed call (after the untimed first, if any)
        exceeds ``TRIAL_DROP`` times another's fastest, once each has two timed calls (one on
        sampled blocks; after one, only those ``TRIAL_DROP_FAR`` times slower); before that, those
        whose untimed first call exceeds ``TRIAL_FIRST_DROP`` times another's fastest timed
        call and by ``TRIAL_FIRST_EXCESS`` seconds. On sampled blocks (no untimed call) a
        candidate leaves after its first call when that is over ``TRIAL_DROP_ONE`` times
        another's: one time each, on blocks of their own, asks for the wider margin. Only the
        layer's own forward leaves for its first call: a plan's first call does the plan's
        one-time work, and its time says nothing of the later calls. Seen twice: on an H200,
        GAT's fused plan, whose backward kernels compiled in its first training call, left the
        trial, and an unfused plan 5x slower was kept; on the CPU, GIN's plan that keeps
        ``A X`` of fixed features (1.76 ms for its first call, which computes it; 0.19 ms
        later) left it, and a plan 1.4x slower was kept. A slow plan still leaves after its
        first timed call when ``TRIAL_DROP_FAR`` times slower."""
        best = {c[0]: min(self.times[c[0]][self.warm:]) for c in self.candidates
                if len(self.times.get(c[0], ())) > self.warm}
        if not best:
            return
        slow = []
        for c in self.candidates:
            if c[0] != ORIGINAL:
                continue        # a plan's first call does its one-time work: no verdict
            ts = self.times.get(c[0], ())
            others = [t for label, t in best.items() if label != c[0]]
            if (len(ts) == 1 and others and ts[0] > TRIAL_FIRST_DROP * min(others)
                    and ts[0] - min(others) > TRIAL_FIRST_EXCESS):
                slow.append(c)
        # on whole graphs two timed calls each, unless ``TRIAL_DROP_FAR`` slower: the first
        # calls of a training run are slowed at random by half and more (the process warming
        # up), one call each is no verdict on a factor of 1.5
        if len(best) == len(self.candidates) >= 2:
            floor = min(best.values())
            once = self.warm == 0 and any(len(self.times[c[0]]) == 1 for c in self.candidates)
            factor = TRIAL_DROP_ONE if once else TRIAL_DROP
            if self.warm and any(len(self.times[c[0]]) < self.warm + 2 for c in self.candidates):
                factor = max(factor, TRIAL_DROP_FAR)
            slow += [c for c in self.candidates if best[c[0]] > factor * floor]
        self.dropped += slow
        self.candidates = [c for c in self.candidates if c not in slow]

    def _timed(self, label):
        """The timed calls of ``label`` (all of them while only untimed ones were made)."""
        ts = self.times[label]
        return ts[self.warm:] or ts

    def medians(self):
        timed = {label: self._timed(label) for label, ts in self.times.items() if ts}
        return {label: sorted(ts)[len(ts) // 2] for label, ts in timed.items()}

    def winner(self):
        """The fastest median; but a plan replaces the layer's own forward only when it beat it
        by ``ORIGINAL_MARGIN``: a few timed calls of a large layer carry several percent of
        noise (and the original's first calls build DGL's formats), and a plan kept by noise
        would be slower than DGL on every later call. Likewise a plan replaces the one the cost
        model ranked first (``predicted``) only when faster by ``PLAN_MARGIN``: the measurement
        corrects the model where it is wrong, not where the two plans are alike; and only when
        its median is below the predicted plan's fastest timed call: a burst of other work on
        the machine that slowed two of the predicted plan's three calls does not overrule the
        model (seen on an unseen graph: GAT's fused plan timed at 21.7 ms in its turns, 3.0 ms
        in steady state, and a plan of 6.3 ms kept instead), while a plan whose calls are
        mostly faster still does (GIN's cached plan at 0.22, 0.18 and 0.17 ms against 0.26,
        0.23 and 0.22: every call faster was too strict a test)."""
        med = self.medians()
        timed = [c for c in self.candidates if c[0] in med]
        if not timed:
            return self.candidates[0]
        best = min(timed, key=lambda c: med[c[0]])
        first = next((c for c in timed if c[0] == self.predicted), None)
        if (first is not None and best is not first and best[0] != ORIGINAL
                and (med[best[0]] > (1 - PLAN_MARGIN) * med[first[0]]
                     or med[best[0]] >= min(self._timed(first[0])))):
            best = first
        original = next((c for c in timed if c[0] == ORIGINAL), None)
        if original is not None and med[best[0]] > (1 - ORIGINAL_MARGIN) * med[ORIGINAL]:
            return original
        return best

    def report(self):
        med = self.medians()
        return [(c[0], med[c[0]]) for c in self.candidates + self.dropped if c[0] in med]


class BackwardClock:
    """The seconds of one layer call's backward: from its output's gradient to the last
    gradient of its inputs and parameters in the same backward pass, read by tensor hooks that
    are removed once read (sequential models run a layer's backward in one stretch). Divided by
    ``scale``.

    The parameters' hooks outlive the pass until the clock is read, which is at the trial's next
    turn: where that comes a step or more later (a graph of another class between), later
    passes fire them too. Only the gradients of the pass that gave the output's count (its
    autograd graph task): a clock that read them all once spanned from one training step's
    backward to the next one's, 10-40 ms for a 0.3 ms layer, and the trial then chose by noise."""

    def __init__(self, outs, tensors, scale, gpu=False):
        self.start = self.end = self.task = None
        self.scale, self.gpu = scale, gpu
        self.handles = [o.register_hook(self._start) for o in outs]    # the first one starts it
        self.handles += [t.register_hook(self._stop) for t in tensors]

    @classmethod
    def of(cls, out, layer, args, scale, gpu=False):
        """A clock for ``out`` when a backward through it can follow, else ``None``; on the GPU
        (``gpu``) each end waits for the device's queued work."""
        if not (isinstance(out, torch.Tensor) and out.requires_grad and torch.is_grad_enabled()):
            return None
        tensors = [p for p in layer.parameters() if p.requires_grad]
        tensors += [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        return cls([out], tensors, scale, gpu) if tensors else None

    def _start(self, grad):
        if self.start is None:
            synchronize(self.gpu)
            self.start = time.perf_counter()
            self.task = torch._C._current_graph_task_id()

    def _stop(self, grad):
        if self.start is not None and torch._C._current_graph_task_id() == self.task:
            synchronize(self.gpu)
            self.end = time.perf_counter()

    def seconds(self):
        if self.start is None or self.end is None or self.end < self.start:
            return None
        return (self.end - self.start) / self.scale

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles = []


def block_scale(call):
    """The size a trial time on a sampled block is divided by (1 on whole graphs)."""
    if not call.gi.is_block:
        return 1.0
    s = call.symbols
    return float(max(s.get("E", 0) + s.get("N_src", 0) + s.get("N_dst", 0), 1))


def _graph_work(call):
    s = call.symbols
    return float(max(s.get("E", 0) + s.get("N", 0) + s.get("N_src", 0) + s.get("N_dst", 0), 1))


def _trial_scale(trial, call):
    """What a tie-break's time of this call is divided by: the block's size on sampled blocks
    (``block_scale``); on a whole graph the ratio of its work to that of the graph whose class
    the trial decides for (1 on that graph itself), so the turns taken on a class's graphs of
    different sizes compare."""
    if call.gi.is_block:
        return block_scale(call)
    size = next((home["size"] for home, key in trial.homes if key == "decision"), None)
    return 1.0 if size is None else _graph_work(call) / size
