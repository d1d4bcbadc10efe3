"""``explain(model)``: for each optimized layer, what granii saw, what it considered and why it chose.

Per layer and call signature: the IR as parsed and after the rewrite, its leaves, how many
association trees were enumerated, pruned and promoted (each promoted plan with its composition and
trees), then for the last decision the predicted cost of every candidate, the chosen plan step by
step (primitive, kernel implementation, when it runs, predicted time) and its generated code;
then what the layer's last call ran: a plan, the layer's own forward as the decision for it, or
its own forward as a fallback, with the reason.
"""
import io
import sys

from . import ir
from .runtime.dispatch import layer_states
from .runtime.state import Compiled
from .memory import fmt_bytes, plan_memory


def explain(model, file=None):
    """Print (and return) for each layer: IR, promoted trees with cost, the choice, its code."""
    if not hasattr(model, "named_modules"):
        raise TypeError(f"granii.explain takes the model given to granii(...), not "
                        f"{type(model).__name__}")
    out = io.StringIO()
    states = layer_states(model)
    if not states:
        print("granii: this model is not optimized (call granii(model, graph, feats) first)",
              file=out)
    for st in states:
        if hasattr(st, "explain"):       # relational layers (granii/hetero.py) explain themselves
            st.explain(lambda *a: print(*a, file=out))
            continue
        _explain_layer(st, out)
    text = out.getvalue()
    print(text, file=file or sys.stdout, end="")
    return text


def describe_ran(ran):
    """One line for a ``dispatch.Ran``: what a layer's call ran, and why when not a plan."""
    if ran.kind == "plan":
        return f"plan {ran.label}" + (f" ({ran.reason})" if ran.reason else "")
    if ran.kind == "original":
        return f"the layer's own forward, {ran.reason}"
    return f"the original forward (not optimized): {ran.reason}"


def _fmt_ms(s):
    return f"{s * 1e3:9.3f} ms"


def _explain_layer(st, out):
    p = lambda *a: print(*a, file=out)
    p(f"== layer '{st.name}' ({type(st.module).__name__}) " + "=" * 40)
    for (present, is_block, _), comp in ((k, c) for k, cs in st.compiled.items() for c in cs):
        sig = ", ".join(sorted(present)) or "no optional arguments"
        p(f"call signature: {sig}{' (block)' if is_block else ''}")
        spec = comp.layer_ir.spec if isinstance(comp, Compiled) else getattr(comp, "spec", [])
        for text, _, value in spec:
            p(f"  specialised on: ({text}) is {value}")
        if isinstance(comp, Exception):
            p(f"  NOT OPTIMIZED, the original forward runs: {comp}")
            continue
        p("  IR as parsed:     " + str(comp.layer_ir.raw))
        p("  after rewrite:    " + str(comp.layer_ir.root))
        p("  leaves:")
        for leaf in {l.name: l for l in ir.leaves(comp.layer_ir.root)}.values():
            p(f"    {leaf.name:<12} [{leaf.rows} x {leaf.cols}] {leaf.kind}/{leaf.sub}")
        n_prom = comp.n_promoted or len(comp.plans)
        p(f"  association trees: {comp.n_trees} enumerated ({comp.n_orders} binary association "
          f"orders in all), {comp.n_trees - n_prom} pruned offline, {n_prom} promoted"
          + (f"; {len(comp.plans) - n_prom} fused variants" if len(comp.plans) > n_prom else ""))
        if getattr(comp, "note", ""):
            p(f"  {comp.note}")
        for plan in comp.plans:
            p(f"    [{plan.index}] scenarios {'/'.join(plan.scenarios):<6} {plan.composition()}")
            p(f"        {plan.trees()}")
        if comp.layer_ir.guards:
            p(f"  checks kept from the source: {len(comp.layer_ir.guards)}")
    ran = getattr(st, "ran", None)
    if ran is not None:
        p(f"  last call ran: {describe_ran(ran)}")
        dgl = sys.modules.get("dgl")         # without DGL loaded, no DGL graph exists
        held = [k for k, v in vars(st.module).items()
                if dgl is not None and isinstance(v, dgl.DGLGraph)]
        if ran.kind == "fallback" and held:
            p(f"  (the layer reads the graph it holds in self.{held[0]}; granii optimizes layers "
              "that take their graph as the first argument of forward)")
    elif st.fallback:
        p(f"  last call ran the original forward: {st.fallback}")
    if st.sampled:
        p(f"  sampled blocks: {len(st.sampled)} sampler configuration(s) decided on their first "
          f"block; {st.reused} later block call(s) reused that decision")
    if st.last is None:
        if not st.fallback:
            p("  no decision yet (the layer has not run on an input)")
        p("")
        return
    symbols, ranking, best, code, training, model_name = st.last
    sizes = " ".join(f"{k}={v}" for k, v in symbols.items())
    p(f"  last input: {sizes}  mode: {'training' if training else 'inference'}  "
      f"cost model: {model_name}")
    p(f"  {'plan':<6}{'predicted':>13}  {'memory (kept + per call)':>26}  composition")
    for c in ranking:
        mark = "  <- chosen" if c is best else ""
        kept, transient = plan_memory(c.plan, symbols)
        mem = f"{fmt_bytes(kept)} + {fmt_bytes(transient)}"
        p(f"  {f'[{c.plan.index}]':<7}{_fmt_ms(c.cost)}  {mem:>26}  {c.plan.composition()}{mark}")
    if getattr(st, "tuned", None):
        times, kept = st.tuned
        p("  measured on the first calls (median forward, + backward in training): " + ", ".join(
            f"{label} {_fmt_ms(t).strip()}" for label, t in times) + f"; kept {kept}")
    if getattr(st, "original_turn", None):
        p(f"  the original forward: {st.original_turn}")
    p("  chosen plan, step by step:")
    for step, impl, t in best.step_costs:
        p(f"    {step.var:<4} {step.prim:<14} {impl:<10} {step.when:<15} {_fmt_ms(t)}  {step.key}")
    p("  generated code:")
    for line in code.splitlines():
        p("    " + line)
    p("")
