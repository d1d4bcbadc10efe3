"""User-defined message, reduce and apply-edges functions, read from their source like ``forward``.

A message function sees ``edges`` and returns per-edge values; a reduce function sees ``nodes`` and
reduces each node's mailbox along dimension 1; an apply-edges function writes edge values. The
interpreter runs their source on symbolic batches, and the values they return lower as DGL's
built-in functions do:

    {'m': edges.src['h']}                          copy_u              A . H
    {'m': edges.src['h'] * edges.data['w']}        u_mul_e             A_w . H
    {'m': c * edges.src['h'] * edges.src['n']}     (n degrees)         A . diag(n) . H, scaled by c
    {'e': f(edges.src['a'] + edges.dst['b'])}      u_add_v, f pure     f(sddmm_add(a, b))
    {'h': nodes.mailbox['m'].sum(1)}               sum                 A . H
    {'h': torch.mean(nodes.mailbox['m'], dim=1)}   mean                D_in^-1 . A . H
    {'h': m.sum(1) / m.shape[1]}                   (the in-degree)     D_in^-1 . A . H
    {'h': torch.max(nodes.mailbox['m'], 1)[0]}     max                 spmm_max(A, H)

DGL calls a reduce function only on nodes with in-edges and gives the others zeros. A result that
keeps those rows zero by itself (products, sums and zero-preserving functions of aggregates) lowers
as it is; any other result (``nodes.data['h'] + m.sum(1)``) is multiplied by the 0/1 vector of
"has in-edges", ``D_in . D_in^-1`` (degrees clamped at 1 in the second).

Spelling does not matter: helper functions and methods are read like the function that calls them,
fields may have any name, and the constant arguments of a pure function are bound by name
(``F.leaky_relu(x, 0.2)`` and ``F.leaky_relu(x, negative_slope=0.2)`` are one IR node). Each
function's source is parsed once per code object.
"""
import ast
import collections
import dataclasses
import inspect
import linecache
import operator
import os
import pickle
import textwrap
import types
import weakref
from collections import ChainMap

import torch
from torch import nn

from .. import diskcache, ir
from . import ops
from .values import (BatchFrame, Degrees, DstValue, EdgeBatch, Edges, Frame, FrontendError,
                     Graph, Mailbox, Message, Method, NodeBatch, Opaque, Shape, Tensor)

_MESSAGE, _REDUCE, _APPLY_EDGES = "message function", "reduce function", "apply-edges function"
_F = torch.nn.functional


def fail(node, construct, reason):
    raise FrontendError(construct, reason, getattr(node, "lineno", None))


# -- reading the source ------------------------------------------------------------------------------
class UserFunction:
    """A Python function given to DGL: its AST (``ast.FunctionDef`` or ``ast.Lambda``), the names
    it sees (``scope``: its closure, then ``globals``), the source its positions refer to,
    arguments already bound (``self`` of a method) and its default values."""

    def __init__(self, node, name, scope, globals_, src, bound=(), defaults=None):
        self.node = node
        self.name = name
        self.scope = scope
        self.globals = globals_
        self.src = src
        self.bound = tuple(bound)
        self.defaults = defaults or {}

    @property
    def first_line(self):
        return self.node.lineno


def user_function(value, node, role):
    """``value`` (a function, lambda or method given to ``update_all``/``apply_edges``) as a
    ``UserFunction``, its source parsed; a ``FrontendError`` saying why not otherwise."""
    if isinstance(value, UserFunction):
        return value
    bound = ()
    if inspect.ismethod(value):
        bound, value = (value.__self__,), value.__func__
    if not isinstance(value, types.FunctionType):
        fail(node, f"{role} of type {type(value).__name__}", "only Python functions, lambdas and "
             "methods are read; other callables run as written")
    try:
        tree, src = _definition(value)
    except (OSError, TypeError, SyntaxError) as e:
        fail(node, f"{role} '{value.__name__}'", f"its source could not be read ({e})")
    scope = dict(inspect.getclosurevars(value).nonlocals)
    return UserFunction(tree, value.__name__, scope, value.__globals__, src, bound,
                        _defaults(value))


def graph_function(it, value, node, role):
    """``user_function`` of a function given to ``update_all``/``apply_edges``, recorded in
    ``it.udfs`` by role and name."""
    fn = user_function(value, node, role)
    it.udfs.append(f"{role} '{fn.name}'")
    return fn


_PARSED = {}     # id(code) -> (weak reference to the code object, what was parsed from it)


def parsed_once(code, parse):
    """``parse()`` of the source of the code object ``code``, once per code object: every layer
    instance, copy and call signature reads the same ``def`` or ``lambda``."""
    hit = _PARSED.get(id(code))
    if hit is not None and hit[0]() is code:
        return hit[1]
    value = parse()
    ident = id(code)
    _PARSED[ident] = (weakref.ref(code, lambda _: _PARSED.pop(ident, None)), value)
    return value


def def_source(func):
    """``textwrap.dedent`` of the source of the ``def`` of ``func``, as ``inspect.getsource``
    gives it (decorators included): ``parsed_def(func)``'s text."""
    return parsed_def(func)[1]


def parsed_def(func):
    """``(node, source)``: the parsed ``def`` of ``func`` (``ast.FunctionDef``, or whatever
    ``inspect``'s source parses to first) and its ``textwrap.dedent``-ed source, without
    tokenizing: the lines from the code object's first line to the last line an instruction of
    it or of a function nested in it spans (``co_positions``), taken from the file's lines as
    ``inspect`` reads them. ``inspect`` finds the end by tokenizing the file from the ``def``
    on, a millisecond or two of a layer's first call. Whatever that cannot give (no positions,
    lines that do not parse as one ``def`` of that name) is read by ``inspect.getsource``. A
    wrapper (``functools.wraps``) reads as the function it wraps, as in ``inspect``. Parsed
    once: the check that the lines are the ``def`` is the parse its readers use."""
    func = inspect.unwrap(func)
    code = getattr(func, "__code__", None)
    last = _last_line(code) if code is not None else None
    if last is not None:
        key = _stored_key(code, last)
        kept = _stored_def(key)
        if kept is not None:
            return kept
        lines = linecache.getlines(code.co_filename, func.__globals__)
        first = code.co_firstlineno
        if 0 < first <= last <= len(lines):
            src = textwrap.dedent("".join(lines[first - 1:last]))
            try:
                body = ast.parse(src).body
            except SyntaxError:
                body = None
            if body and len(body) == 1 and isinstance(body[0], ast.FunctionDef) \
                    and body[0].name == code.co_name:
                if key is not None:
                    diskcache.store("ast", key, pickle.dumps((body[0], src)))
                return body[0], src
    src = textwrap.dedent(inspect.getsource(func))
    return ast.parse(src).body[0], src


def _stored_key(code, last):
    """The store's key of the ``def`` at lines ``code.co_firstlineno``-``last`` of its file: the
    file's size and modification time (what Python's byte-code cache checks) and this module's
    stamp; ``None`` for a file that cannot be read."""
    stamp = diskcache.stamp(__name__)
    try:
        st = os.stat(code.co_filename)
    except (OSError, TypeError, ValueError):
        return None
    if stamp is None:
        return None
    return (f"{stamp}\n{code.co_filename}:{st.st_size}:{st.st_mtime_ns}\n"
            f"{code.co_name}:{code.co_firstlineno}:{last}").encode()


def _stored_def(key):
    """``(node, source)`` kept in the store for ``key`` by an earlier process, or ``None``:
    unpickling the parsed ``def`` takes half the time of reading and parsing it (0.4 against
    1.1 ms for GraphConv's forward)."""
    data = diskcache.load("ast", key) if key is not None else None
    if data is None:
        return None
    try:
        node, src = pickle.loads(data)
    except Exception:              # noqa: BLE001 - a damaged entry is a miss
        return None
    return (node, src) if isinstance(node, ast.FunctionDef) and isinstance(src, str) else None


def _last_line(code):
    """The last source line of ``code`` and the code objects in its constants, or ``None``."""
    positions = getattr(code, "co_positions", None)
    if positions is None:
        return None
    # the end lines of the instructions (None for those without a position), in C
    last = max(filter(None, map(operator.itemgetter(1), positions())), default=None)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            inner = _last_line(c)
            if inner is not None:
                last = inner if last is None else max(last, inner)
    return last


def _definition(func):
    return parsed_once(func.__code__, lambda: _parse_definition(func))


def _parse_definition(func):
    """``(ast node, source text)`` of ``func``: its own source for a ``def``; for a lambda the
    whole file, since the lines of a lambda are often not a statement on their own."""
    if func.__name__ != "<lambda>":
        node, src = parsed_def(func)
        if not isinstance(node, ast.FunctionDef) or node.decorator_list:
            raise SyntaxError("not a plain (undecorated) def")
        return node, src
    lines, start = inspect.findsource(func)
    src = "".join(lines)
    found = [n for n in ast.walk(ast.parse(src))
             if isinstance(n, ast.Lambda) and n.lineno == start + 1
             and _same_args(n, func) and _covers(n, func)]
    if len(found) != 1:
        raise SyntaxError(f"{len(found)} lambdas on line {start + 1} match it")
    return found[0], src


def _same_args(lam, func):
    code = func.__code__
    return [a.arg for a in lam.args.args] == list(code.co_varnames[:code.co_argcount])


def _covers(lam, func):
    """The lambda's span holds every source position of ``func``'s code."""
    start, end = (lam.lineno, lam.col_offset), (lam.end_lineno, lam.end_col_offset)
    for line, _, col, end_col in func.__code__.co_positions():
        if line is None or col is None or end_col <= col:    # no span (the entry instruction)
            continue
        if not (start <= (line, col) and (line, end_col) <= end):
            return False
    return True


def _defaults(func):
    code = func.__code__
    names = code.co_varnames[:code.co_argcount]
    out = dict(zip(names[len(names) - len(func.__defaults__ or ()):], func.__defaults__ or ()))
    out.update(func.__kwdefaults__ or {})
    return out


def defined_in_source(it, node):
    """A ``def`` or ``lambda`` met in the code being read: it sees the names of that code."""
    args = node.args
    defaults = {}
    pos = args.posonlyargs + args.args
    for a, d in zip(pos[len(pos) - len(args.defaults):], args.defaults):
        defaults[a.arg] = it.eval(d)
    for a, d in zip(args.kwonlyargs, args.kw_defaults):
        if d is not None:
            defaults[a.arg] = it.eval(d)
    name = getattr(node, "name", "<lambda>")
    return UserFunction(node, name, it.env, it.globals, it.src, (), defaults)


def bind(fn, args, kwargs, node):
    """The local names of a call of ``fn``."""
    a = fn.node.args
    if a.vararg or a.kwarg:
        fail(node, f"function '{fn.name}' with *args or **kwargs", "not read by the frontend")
    names = [p.arg for p in a.posonlyargs + a.args]
    values = list(fn.bound) + list(args)
    if len(values) > len(names):
        fail(node, f"call of '{fn.name}'", "with more arguments than it takes")
    local = dict(fn.defaults)
    local.update(zip(names, values))
    for k, v in kwargs.items():
        if k not in names and k not in {p.arg for p in a.kwonlyargs}:
            fail(node, f"call of '{fn.name}'", f"with an unknown argument '{k}'")
        local[k] = v
    missing = [n for n in names + [p.arg for p in a.kwonlyargs] if n not in local]
    if missing:
        fail(node, f"call of '{fn.name}'", f"argument '{missing[0]}' not given")
    return ChainMap(local, fn.scope)


# -- update_all and apply_edges ------------------------------------------------------------------------
def is_builtin_message(f):
    return hasattr(f, "out_field") and hasattr(f, "name")


def is_builtin_reduce(f):
    return hasattr(f, "msg_field") and hasattr(f, "name")


def update_all(it, graph, msg, red, node):
    """``graph.update_all(msg, red)`` with at least one of them a Python function."""
    msgs = builtin_messages(it, graph, msg, node) if is_builtin_message(msg) else \
        run_message(it, graph, graph_function(it, msg, node, _MESSAGE), node)
    if is_builtin_reduce(red):
        if red.msg_field not in msgs:
            fail(node, "update_all", f"the reduce function reads message field "
                 f"'{red.msg_field}', which the message function does not write")
        out = {red.out_field: aggregate(it, msgs[red.msg_field], red.name, node)}
    else:
        out = run_reduce(it, graph, graph_function(it, red, node, _REDUCE), msgs, node)
        edges_guard(it)
    for k, v in out.items():
        graph.frames["dst"][k] = v


def edges_guard(it):
    """On a graph without edges DGL calls no reduce function and writes no field: such a graph
    runs the original forward."""
    name = it.func.args.args[1].arg
    text = (f"assert {name}.num_edges() > 0, 'a reduce function on a graph without edges "
            "writes no field'")
    if (text, [name]) not in it.guards:
        it.guards.append((text, [name]))


def apply_edges(it, graph, func, node):
    """``graph.apply_edges(f)`` with a Python function ``f``: the edge values it returns."""
    fn = graph_function(it, func, node, _APPLY_EDGES)
    out = returned_fields(it.call_user(fn, [EdgeBatch(graph)], {}, _APPLY_EDGES, node),
                          fn, _APPLY_EDGES, node)
    for k, v in out.items():
        if not isinstance(v, Edges):
            fail(node, f"apply-edges function '{fn.name}' writing '{k}'", f"a {kind_of(v)}: "
                 "only edge scores (u_add_v, functions of them) are lowered")
        graph.frames["edge"][k] = v


def builtin_messages(it, graph, msg, node):
    """The ``Message`` a built-in message function writes (copy_u, u_mul_e)."""
    if msg.name == "copy_u":
        return {msg.out_field: Message(ops._frame_tensor(it, graph, msg.in_field, node))}
    if msg.name in ("u_mul_e", "e_mul_u"):
        ufield, efield = ((msg.lhs_field, msg.rhs_field) if msg.lhs == ops._U
                          else (msg.rhs_field, msg.lhs_field))
        w = ops.frame_get(Frame(graph, "edge"), efield, it, node)
        if not isinstance(w, Edges):
            fail(node, f"u_mul_e with edge field '{efield}'", "the field holds no edge values")
        return {msg.out_field: Message(ops._frame_tensor(it, graph, ufield, node), w)}
    fail(node, f"message function fn.{msg.name}", "not lowered yet")


def run_message(it, graph, fn, node):
    out = returned_fields(it.call_user(fn, [EdgeBatch(graph)], {}, _MESSAGE, node), fn,
                          _MESSAGE, node)
    for k, v in out.items():
        if not isinstance(v, Message) or not isinstance(v.x, Tensor):
            fail(node, f"message function '{fn.name}' writing '{k}'",
                 f"a {kind_of(v)}: only source features times edge values, degrees and "
                 "numbers are lowered")
    return out


def run_reduce(it, graph, fn, msgs, node):
    """The fields a reduce function writes: each an IR expression of aggregates of ``msgs``,
    made zero on nodes without in-edges when it is not so by itself."""
    sites = it.sites
    batch = NodeBatch(graph, msgs)
    out = returned_fields(it.call_user(fn, [batch], {}, _REDUCE, node), fn, _REDUCE, node)
    for k, v in out.items():
        if not isinstance(v, Tensor):
            fail(node, f"reduce function '{fn.name}' writing '{k}'", f"a {kind_of(v)}: only "
                 "sums, means and maxima of the mailbox along dimension 1 are lowered")
        bad = _impure_since(v.node, sites)
        if bad is not None:
            fail(node, f"{bad.label}() in reduce function '{fn.name}'", "DGL calls a reduce "
                 "function once per group of nodes of equal in-degree; only functions known to "
                 "be pure and row-wise are lowered there")
        out[k] = zero_without_in_edges(it, v, fn, node)
    return out


def returned_fields(value, fn, role, node):
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        fail(node, f"{role} '{fn.name}'", f"returns a {type(value).__name__}, not a dict of "
             "fields")
    return dict(value)


def kind_of(v):
    return {Message: "per-edge copy of node features", DstValue: "value of destination nodes",
            Mailbox: "mailbox", Edges: "edge value"}.get(type(v), type(v).__name__)


def _impure_since(node, sites):
    """An impure ``Apply`` under ``node`` made after call number ``sites``, or ``None``."""
    if isinstance(node, ir.Apply) and not node.pure and node.site > sites:
        return node
    for c in ir.children(node):
        bad = _impure_since(c, sites)
        if bad is not None:
            return bad
    return None


# -- aggregation -----------------------------------------------------------------------------------
def adjacency(it, msg):
    """The sparse operand of ``msg``'s aggregation: ``A``, ``A_w`` or ``A[e]``."""
    w, x = msg.w, msg.x
    if w is None or w.ones:
        return it.leaf("A", it.n_dst, it.n_src, ir.SPARSE, ir.UNWEIGHTED, ("graph",))
    if w.node is not None:
        heads = it.heads[0] if x.ndim == 3 and it.heads else 1
        return ir.SparseEdges(w.node, it.n_dst, it.n_src, heads, x.node.cols)
    return it.leaf("A_w", it.n_dst, it.n_src, ir.SPARSE, ir.WEIGHTED, ("edge", w.arg))


def aggregate(it, msg, how, node):
    """``how`` (sum, mean, max) of the messages ``msg`` over each destination's in-edges:

        sum   c A_w X          mean   c D_in^-1 A_w X          max   c spmm_max(A, X)  (c > 0)
    """
    if not isinstance(msg, Message) or not isinstance(msg.x, Tensor):
        fail(node, f"reduction of a {kind_of(msg)}", "only messages of source features are "
             "lowered")
    x = msg.x
    if x.ndim != 2 and not (x.ndim == 3 and msg.w is not None and msg.w.node is not None):
        fail(node, "update_all on features with more than 2 dimensions", "only attention "
             "(per-head edge values times (N, heads, F) features) is lowered")
    if how == "sum":
        out = ir.matmul(adjacency(it, msg), x.node)
    elif how == "mean":
        out = ir.matmul(Degrees("in", -1.0, 1.0).leaf(it.n_dst), adjacency(it, msg), x.node)
    elif how == "max" and (msg.w is None or msg.w.ones) and msg.c > 0:
        out = ir.Aggregate("spmm_max", x.node)
    else:
        weighted = " of edge-weighted messages" if msg.w is not None else ""
        fail(node, f"reduction '{how}'{weighted}", "not in the IR (sum, mean; max of unweighted "
             "messages)")
    out = Tensor(out, x.ndim)
    return out if msg.c == 1 else ops.scale(it, out, msg.c, node)


_ZERO_AT_ZERO = frozenset(f for f in (
    torch.relu, _F.relu, torch.tanh, _F.tanh, _F.elu, _F.leaky_relu, _F.gelu, _F.silu, _F.relu6,
    _F.selu, _F.celu, _F.mish, _F.hardtanh, torch.abs, torch.square, torch.neg) if f is not None)


def zero_without_in_edges(it, value, fn, node):
    """``value`` with its rows of nodes without in-edges zero, as DGL leaves them."""
    if _zero_rows(value.node):
        return value
    if not _finite(value.node):
        fail(node, f"result of reduce function '{fn.name}'", "it is not zero on nodes without "
             "in-edges and holds a degree power that is infinite there")
    has = Degrees("in").leaf(it.n_dst)
    inv = Degrees("in", -1.0, 1.0).leaf(it.n_dst)
    return Tensor(ir.RowBroadcast(has, ir.RowBroadcast(inv, value.node)), value.ndim)


def _zero_rows(n):
    """Rows of nodes without in-edges are zero in ``n`` whatever the features."""
    if isinstance(n, ir.SparseEdges) or (isinstance(n, ir.Leaf) and n.kind == ir.SPARSE
                                        and n.sub in (ir.UNWEIGHTED, ir.WEIGHTED)):
        return True
    if isinstance(n, ir.Aggregate):
        return True
    if isinstance(n, ir.MatMul):
        for a in n.args:
            if _zero_rows(a):
                return True
            if not (_row_scale(a) and _finite(a)):
                return False
        return False
    if isinstance(n, ir.RowBroadcast):
        return _finite(n.vec) and _zero_rows(n.x)
    if isinstance(n, ir.Add):
        return _zero_rows(n.a) and _zero_rows(n.b)
    if isinstance(n, ir.Cat):
        return all(_zero_rows(p) for p in n.parts)
    if isinstance(n, ir.Apply):
        return _keeps_zero(n.ref) and _zero_rows(n.x)
    return False


def _row_scale(n):
    return isinstance(n, ir.Leaf) and n.sub in (ir.DIAGONAL, ir.SCALAR)


def _keeps_zero(ref):
    if ref[:1] in (("scale",), ("detach",), ("dropout",)):
        return True
    try:
        return ref[0] == "function" and getattr(ref[1], "func", ref[1]) in _ZERO_AT_ZERO
    except TypeError:
        return False


def _finite(n):
    """No degree power under ``n`` is infinite on a node of degree 0."""
    return all(not (l.source[0] == "degree" and l.source[2] < 0 and not l.source[3]
                    and l.source[4] <= 0) for l in ir.leaves(n))


# -- values inside user functions --------------------------------------------------------------------
def attr(it, obj, name, node):
    """``edges.src``, ``nodes.mailbox``, ... and methods of the values of user functions."""
    if isinstance(obj, EdgeBatch) and name in ("src", "dst", "data"):
        return BatchFrame(obj, name)
    if isinstance(obj, NodeBatch) and name in ("data", "mailbox"):
        return BatchFrame(obj, name)
    if isinstance(obj, Mailbox) and name == "shape":
        return Shape(obj.ndim, degree_dim=1)
    if isinstance(obj, Message) and name == "shape":
        return Shape(obj.x.ndim)
    if isinstance(obj, (Message, Mailbox, DstValue)):
        return Method(obj, name)
    what = type(obj).__name__.lower() if not isinstance(obj, Opaque) else obj.text
    fail(node, f"'{name}' of {what}", "not lowered")


def frame_item(it, frame, key, node):
    """``edges.src[k]`` (a ``Message``), ``edges.dst[k]``, ``edges.data[k]``, ``nodes.data[k]``,
    ``nodes.mailbox[k]``."""
    graph = frame.batch.graph
    if frame.which == "mailbox":
        if key not in frame.batch.mailbox:
            fail(node, f"nodes.mailbox[{key!r}]", "the message function writes no such field")
        return Mailbox(frame.batch.mailbox[key])
    which = {"src": "src", "dst": "dst", "data": "edge" if isinstance(frame.batch, EdgeBatch)
             else "dst"}[frame.which]
    value = ops.frame_get(Frame(graph, which), key, it, node)
    if frame.which == "src":
        return Message(value) if isinstance(value, (Tensor, Degrees)) else value
    if frame.which == "dst" and isinstance(frame.batch, EdgeBatch):
        return DstValue(value)
    return value


def binop(it, op, a, b, node):
    """Arithmetic with per-edge values and mailboxes."""
    if op == "Mult" and isinstance(b, Message) and not isinstance(a, Message):
        a, b = b, a
    if op == "Add" and isinstance(a, DstValue) and isinstance(b, Message):
        a, b = b, a
    if op == "Mult" and (isinstance(a, DstValue) or isinstance(b, DstValue)):
        fail(node, "product of source and destination values", "dot products and other "
             "u_mul_v messages are not in the IR")
    if isinstance(a, Message):
        if op == "Mult":
            return message_times(it, a, b, node)
        if op == "Div" and isinstance(b, (int, float)):
            return message_times(it, a, 1.0 / b, node)
        if op == "Div" and isinstance(b, Message) and isinstance(b.x, Degrees) and b.w is None:
            inv = Message(dataclasses.replace(b.x, power=-b.x.power), None, 1.0 / b.c)
            return message_times(it, a, inv, node)
        if op == "Add" and isinstance(b, DstValue):
            return edge_score(it, a, b, node)
        if op == "MatMult":
            return message_matmul(it, a, b, node)
    if isinstance(a, Mailbox) and op in ("Mult", "Div") and isinstance(b, (int, float)):
        return Mailbox(message_times(it, a.msg, b if op == "Mult" else 1.0 / b, node))
    if isinstance(a, (int, float)) and isinstance(b, Mailbox) and op == "Mult":
        return Mailbox(message_times(it, b.msg, a, node))
    fail(node, f"operator {op} on {kind_of(a)} and {kind_of(b)}", "not lowered")


def message_times(it, m, b, node):
    """``m * b`` for a number, edge values, or source degrees ``b``."""
    if isinstance(b, (int, float)) and not isinstance(b, bool):
        return Message(m.x, m.w, m.c * float(b))
    if isinstance(b, Edges):
        if m.w is not None:
            fail(node, "product of two edge values in a message", "not lowered")
        return Message(m.x, b, m.c)
    if isinstance(b, Message):
        if m.w is not None and b.w is not None:
            fail(node, "product of two edge values in a message", "not lowered")
        x, d = (m.x, b.x) if isinstance(b.x, Degrees) else (b.x, m.x)
        if not isinstance(d, Degrees):
            fail(node, "element-wise product of two source features", "not in the IR")
        if isinstance(x, Degrees):
            fail(node, "product of two degree vectors in a message", "not lowered")
        return Message(ops.row_broadcast(it, x, d, node), m.w or b.w, m.c * b.c)
    fail(node, f"message times {kind_of(b)}", "not lowered")


def message_matmul(it, m, w, node):
    """``(c w_e x_u) W = c w_e (x W)_u``: the product moves before the gather."""
    if not isinstance(m.x, Tensor):
        fail(node, "product of a degree message", "not lowered")
    return Message(ops.matmul(it, m.x, w, node), m.w, m.c)


def edge_score(it, m, d, node):
    """``x_u + y_v`` of each edge: an SDDMM."""
    if not (isinstance(m.x, Tensor) and isinstance(d.x, Tensor)) or m.w is not None or m.c != 1:
        fail(node, "sum of source and destination values", "only plain features (u_add_v) "
             "are lowered")
    return Edges(node=ir.EdgeScore(m.x.node, d.x.node))


def call_method(it, obj, name, args, kwargs, node):
    if isinstance(obj, Mailbox) and name == "size" and not kwargs:
        shape = Shape(obj.ndim, degree_dim=1)
        return shape[args[0]] if len(args) == 1 and isinstance(args[0], int) else shape
    if isinstance(obj, Mailbox):
        return reduce_call(it, name, obj, args, kwargs, node)
    if isinstance(obj, Message) and name in ops._SAME_VALUE_METHODS - {"detach"}:
        return obj
    fail(node, f".{name}() of a {kind_of(obj)}", "not lowered")


_REDUCTIONS = {"sum": "sum", "mean": "mean", "max": "max", "amax": "max"}


def reduce_call(it, name, mb, args, kwargs, node):
    """``mb.sum(1)``, ``torch.mean(mb, dim=1)``, ``mb.max(1)`` (values and indices), ..."""
    how = _REDUCTIONS.get(name)
    if how is None:
        fail(node, f"{name}() of the mailbox", "only sum, mean and max along dimension 1 are "
             "lowered")
    kw = dict(kwargs)
    dim = kw.pop("dim", kw.pop("axis", args[0] if args else None))
    keepdim = kw.pop("keepdim", args[1] if len(args) > 1 else False)
    if kw or len(args) > 2 or dim is None or not isinstance(dim, int) \
            or dim % mb.ndim != 1 or keepdim:
        fail(node, f"{name}() of the mailbox", "only along dimension 1, without keepdim, is "
             "lowered")
    out = aggregate(it, mb.msg, how, node)
    if name == "max":
        return MaxResult(out, Opaque("argmax indices of the mailbox"))
    return out


MaxResult = collections.namedtuple("MaxResult", "values indices")


def call_function(it, func, args, kwargs, node):
    """Calls inside user functions: reductions of the mailbox, pure functions of per-edge
    values, helper functions (read like the caller)."""
    if isinstance(func, UserFunction):
        return it.call_user(func, args, kwargs, func.name, node)
    first = args[0] if args else None
    if isinstance(first, Mailbox) and func in (torch.sum, torch.mean, torch.max, torch.amax):
        return reduce_call(it, func.__name__, first, args[1:], kwargs, node)
    if isinstance(func, (types.FunctionType, types.MethodType)) and _own_code(func):
        return it.call_user(user_function(func, node, "helper function"), args, kwargs,
                            func.__name__, node)
    ref = pure_ref(func, args, kwargs)
    if ref is not None and isinstance(first, Message):
        if first.w is not None or first.c != 1 or not isinstance(first.x, Tensor):
            fail(node, f"{ref[0]}() of a weighted or scaled message", "not lowered")
        return Message(Tensor(ops.apply(it, ref[0], first.x.node, ref[1], pure=True),
                              first.x.ndim))
    if ref is not None and isinstance(first, Edges):
        e = ops.edge_node(it, first, node)
        return Edges(node=ops.apply(it, ref[0], e, ref[1], pure=True))
    if isinstance(func, nn.Linear) and isinstance(first, Message):
        if first.w is not None or first.c != 1:
            fail(node, "nn.Linear of a weighted or scaled message", "not lowered")
        return Message(ops.linear(it, func, first.x, node))
    name = getattr(func, "__name__", type(func).__name__)
    held = next(kind_of(a) for a in list(args) + list(kwargs.values()) if _holds_udf(a))
    fail(node, f"{name}() of a {held}", "not lowered (only pure element-wise functions of "
         "source features and edge scores, and sum/mean/max of the mailbox)")


def _own_code(func):
    """A function of the user's code (not of torch, DGL or another library)."""
    mod = getattr(func, "__module__", "") or ""
    return not mod.split(".")[0] in ("torch", "dgl", "numpy", "builtins", "functools")


def pure_ref(func, args, kwargs):
    """``(label, ref)`` of ``func`` applied to its first argument, the others constants, when
    ``func`` is a known pure function; else ``None``. Equal calls give equal refs however they
    are spelled: ``F.leaky_relu(x, 0.2)``, ``F.leaky_relu(x, negative_slope=0.2)``."""
    if not ops._known_pure(func) or not args or func in _ACROSS_ROWS and \
            not _within_rows(func, args, kwargs):
        return None
    rest = list(args[1:]) + list(kwargs.values())
    if not all(isinstance(v, (int, float, bool, str, type(None))) for v in rest):
        return None
    bound = constant_arguments(func, args[1:], kwargs)
    if bound is None:
        return None
    args, kwargs = bound
    name = getattr(func, "__name__", "f")
    if not args and not kwargs:
        return name, ("function", func)
    shown = [repr(v) for v in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"{name}({', '.join(shown)})", ("function", WithArgs(func, args, kwargs))


def constant_arguments(func, args, kwargs):
    """``(args, kwargs)`` of the arguments after the first: by name in the order of ``func``'s
    signature, without those equal to their defaults and without ``inplace`` (the value is the
    same); as written for a builtin without a signature; ``None`` when they do not bind."""
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError):
        return tuple(args), dict(kwargs)
    try:
        bound = sig.bind(None, *args, **kwargs).arguments
    except TypeError:
        return None
    named = {}
    for k, v in list(bound.items())[1:]:
        default = sig.parameters[k].default
        same = v == default and isinstance(v, bool) == isinstance(default, bool)
        if k != "inplace" and not same:
            named[k] = v
    return (), named


class WithArgs:
    """``func(x, *args, **kwargs)`` as a function of ``x`` (``F.leaky_relu(x, 0.2)``); equal
    for equal constants, so equal code lowers to equal IR."""
    stable_fields = ("func", "args", "kwargs")       # what it compares by (ir.stable_text)

    def __init__(self, func, args, kwargs):
        self.func, self.args, self.kwargs = func, tuple(args), tuple(sorted(kwargs.items()))

    def __call__(self, x):
        return self.func(x, *self.args, **dict(self.kwargs))

    def __eq__(self, other):
        return isinstance(other, WithArgs) and (self.func, self.args, self.kwargs) == \
            (other.func, other.args, other.kwargs)

    def __hash__(self):
        return hash((self.func, self.args, self.kwargs))


def leaky_relu_slope(ref):
    """The negative slope of the ``Apply`` ref of ``F.leaky_relu`` with constant arguments (what
    a fusion pass needs to run it inside a kernel), or ``None`` for any other ref."""
    f = ref[1] if ref[:1] == ("function",) else None
    if f is _F.leaky_relu:
        return 0.01
    if isinstance(f, WithArgs) and f.func is _F.leaky_relu and not f.args:
        kwargs = dict(f.kwargs)
        if set(kwargs) <= {"negative_slope"}:
            return float(kwargs.get("negative_slope", 0.01))
    return None


_ACROSS_ROWS = (_F.normalize, _F.softmax, _F.log_softmax)   # a dim argument may span rows


def _within_rows(func, args, kwargs):
    """Whether ``func`` (one of ``_ACROSS_ROWS``) reads each row of its 2-D first argument alone:
    its ``dim`` is the last (``F.normalize(out, p=2., dim=-1)``, SAGEConv's ``normalize``), so
    the call is a pure function of each row."""
    try:
        bound = inspect.signature(func).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return False
    bound.apply_defaults()
    dim = bound.arguments.get("dim")
    return getattr(args[0], "ndim", None) == 2 and type(dim) is int and dim in (-1, 1)


def _holds_udf(a):
    from .values import UDF_VALUES
    if isinstance(a, UDF_VALUES):
        return True
    if isinstance(a, (list, tuple)):
        return any(_holds_udf(x) for x in a)
    return False


__all__ = ["UserFunction", "user_function", "update_all", "apply_edges", "Graph"]
