"""Partial evaluation of a layer's ``forward`` source into the matrix IR.

The interpreter walks the AST of the *installed* ``forward`` method. Expressions that depend only on
the module's configuration (``self._norm``, ``self.bias is not None``, ``edge_weight is not None``)
are evaluated to ordinary Python values, so branches on them are resolved; expressions on the graph
and on tensors become symbolic values (``values.py``) and, through the rules of ``rules.py``, IR
nodes. A graph-dependent ``if`` whose body only raises (DGL's zero in-degree check) and an
``assert`` become *guards*: their source is kept and run at call time, so the user sees DGL's own
error. Anything else the interpreter does not know stops it with a ``FrontendError`` naming the
construct; the caller then runs the original module.
"""
import ast
import builtins
import functools
import operator
import re

import torch

from .. import ir
from . import rules, udf
from .values import (UDF_VALUES, BatchFrame, Degrees, Edges, Frame, FrontendError, Graph,
                     GraphCondition, LocalScope, HeadProduct, Method, ParamItem, RaisesForConfig,
                     Scalar, Shape, Tensor)

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.Pow: operator.pow, ast.MatMult: operator.matmul,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
_CMPOPS = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
           ast.Gt: operator.gt, ast.GtE: operator.ge, ast.In: lambda a, b: a in b,
           ast.NotIn: lambda a, b: a not in b, ast.Is: operator.is_, ast.IsNot: operator.is_not}
_SYMBOLIC = (Tensor, Edges, Degrees, Graph, Frame, Shape, GraphCondition, Method, Scalar,
             HeadProduct, ParamItem) + UDF_VALUES


@functools.lru_cache(maxsize=32)
def _lines(src):
    return re.findall(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+\Z", src)    # lines as ``ast`` splits them


def source_segment(src, node):
    """``ast.get_source_segment(src, node)``, with ``src`` split into lines once per source (the
    standard function splits the whole source again at each call: a millisecond a layer)."""
    try:
        lines = _lines(src)
        first, last = node.lineno - 1, node.end_lineno - 1
        start, end = node.col_offset, node.end_col_offset
    except (AttributeError, TypeError):
        return None
    if end is None or last >= len(lines):
        return None
    if first == last:
        return lines[first].encode()[start:end].decode()
    return "".join([lines[first].encode()[start:].decode(), *lines[first + 1:last],
                    lines[last].encode()[:end].decode()])


class _Return(Exception):
    def __init__(self, value):
        self.value = value


def forward_ast(cls):
    """The parsed ``forward`` of ``cls`` (the source installed on this machine) and its globals."""
    fwd = cls.forward
    code = getattr(fwd, "__code__", None)
    node, src = (udf.parsed_once(code, lambda: _parse_forward(fwd)) if code is not None
                 else _parse_forward(fwd))
    return node, fwd.__globals__, src


def _parse_forward(fwd):
    return udf.parsed_def(fwd)


class Interpreter:
    """Evaluates one ``forward`` for one module and one set of present/absent arguments."""

    def __init__(self, module, func_def, globals_, src, is_block=False, real=None):
        self.module = module
        self.real = real or {}    # the call's actual arguments: decides graph-dependent branches
        # on a graph sources and destinations are the same nodes: one symbol, N
        self.n_src, self.n_dst = ("N_src", "N_dst") if is_block else ("N", "N")
        self.globals = globals_
        self.src = src
        self.func = func_def
        self.env = {}
        self.guards = []          # (source text, names it reads): checks that raise
        self.spec = []            # (condition text, names, value): branches taken for this input
        self.config = {}          # module attribute -> summary of the value the code branched on
        self.heads = None         # (H, F) once features are split into attention heads
        self.leaves = {}
        self.sites = 0            # calls of functions so far (``rules.apply``)
        self.where = None         # the user-defined function being read, None in forward
        self.udfs = []            # message, reduce and apply-edges functions read (by role)
        self.inlined = {}         # id(submodule) -> its dotted path, while its forward is read
        self.inline_inputs = []   # [input, (in, out) of the first nn.Linear applied to it]

    # -- entry -------------------------------------------------------------------------------
    def run(self, bound):
        """``bound``: argument name -> symbolic value, or ``None`` for an absent argument."""
        self.env.update(bound)
        try:
            self.exec_block(self.func.body)
        except _Return as r:
            return r.value
        raise FrontendError("forward without return", "the function does not return a value")

    def fail(self, node, construct, reason):
        raise FrontendError(construct, reason, getattr(node, "lineno", None))

    def call_user(self, fn, args, kwargs, role, node):
        """The value of ``fn(*args, **kwargs)``, ``fn`` a ``udf.UserFunction`` read from its
        source with the names it sees; errors name ``role`` and a line counted from its first."""
        local = udf.bind(fn, args, kwargs, node)
        saved = self.env, self.globals, self.src, self.where
        self.env, self.globals, self.src = local, fn.globals, fn.src
        self.where = f"{role} '{fn.name}'" if role != fn.name else f"function '{fn.name}'"
        try:
            if isinstance(fn.node, ast.Lambda):
                return self.eval(fn.node.body)
            try:
                self.exec_block(fn.node.body)
            except _Return as r:
                return r.value
            return None
        except FrontendError as e:
            if e.where is not None:
                raise
            line = e.lineno - fn.first_line + 1 if e.lineno else None
            raise FrontendError(e.construct, e.reason, line, self.where) from None
        finally:
            self.env, self.globals, self.src, self.where = saved

    # -- statements --------------------------------------------------------------------------
    def exec_block(self, stmts):
        for s in stmts:
            self.exec_stmt(s)

    def exec_stmt(self, s):
        kind = type(s).__name__
        handler = getattr(self, "stmt_" + kind, None)
        if handler is None:
            self.fail(s, f"statement '{kind}'", "not understood by the frontend")
        handler(s)

    def stmt_Expr(self, s):
        if isinstance(s.value, ast.Constant):
            return
        self.eval(s.value)

    def stmt_Pass(self, s):
        pass

    def stmt_FunctionDef(self, s):
        if s.decorator_list:
            self.fail(s, f"decorated function '{s.name}'", "not read by the frontend")
        self.env[s.name] = udf.defined_in_source(self, s)

    def stmt_Return(self, s):
        raise _Return(self.eval(s.value) if s.value is not None else None)

    def stmt_Assign(self, s):
        value = self.eval(s.value)
        for t in s.targets:
            self.assign(t, value)

    def stmt_AugAssign(self, s):
        value = self.binop(s.op, self.eval(s.target), self.eval(s.value), s)
        self.assign(s.target, value)

    def assign(self, target, value):
        if isinstance(target, ast.Name):
            self.env[target.id] = value
        elif isinstance(target, (ast.Tuple, ast.List)):
            items = list(value) if not isinstance(value, _SYMBOLIC) else None
            if items is None or len(items) != len(target.elts):
                self.fail(target, "tuple unpacking", "of a value that is not a known tuple")
            for t, v in zip(target.elts, items):
                self.assign(t, v)
        elif isinstance(target, ast.Attribute) and self.eval(target.value) is self.module:
            if not isinstance(value, Tensor):
                self.fail(target, f"assignment to self.{target.attr}", "of a non-tensor value")
            # later uses of the same value read the stored one, as the original code does
            value.node = ir.Store(target.attr, value.node)
        elif isinstance(target, ast.Subscript):
            obj = self.eval(target.value)
            key = self.eval(target.slice)
            if isinstance(obj, Frame):
                rules.frame_set(obj, key, value, self)
            else:
                self.fail(target, "item assignment", "only graph frames (srcdata, dstdata, edata)")
        else:
            self.fail(target, f"assignment to {type(target).__name__}", "not supported")

    def stmt_If(self, s):
        cond = self.eval(s.test)
        if isinstance(cond, GraphCondition):
            if all(isinstance(b, ast.Raise) for b in s.body) and not s.orelse:
                self.add_guard(s)
                return
            cond = self.specialize(s.test)
        self.exec_block(s.body if self.truth(cond, s) else s.orelse)

    def specialize(self, test):
        """Decide a branch on the graph or tensors with this call's values, and remember it: the
        plan is only reused for inputs where the condition has the same value."""
        text = ast.unparse(test)
        if self.where is not None:
            self.fail(test, f"branch on '{text}'", "depends on the data the function is called "
                      "on (DGL may call it on parts of the graph); not lowered")
        names = sorted({n.id for n in ast.walk(test) if isinstance(n, ast.Name)})
        if not self.real:
            self.fail(test, f"branch on '{text}'", "depends on the input and no input was given")
        ns = dict(self.globals)
        ns.update(self.real)
        try:
            value = bool(eval(compile(ast.Expression(test), "<condition>", "eval"), ns))
        except Exception as e:  # noqa: BLE001 - reported as the construct that stopped us
            self.fail(test, f"branch on '{text}'", f"could not evaluate it on this input ({e})")
        self.spec.append((text, names, value))
        return value

    def stmt_Assert(self, s):
        cond = self.eval(s.test)
        if isinstance(cond, GraphCondition) or isinstance(cond, _SYMBOLIC):
            self.add_guard(s)
        elif not cond:
            raise RaisesForConfig("assertion fails for this configuration")

    def stmt_Raise(self, s):
        raise RaisesForConfig(source_segment(self.src, s) or "raise")

    def stmt_With(self, s):
        for item in s.items:
            ctx = self.eval(item.context_expr)
            if not isinstance(ctx, LocalScope):
                self.fail(s, "with-statement", "only graph.local_scope() is understood")
            if item.optional_vars is not None:
                self.assign(item.optional_vars, ctx)
        self.exec_block(s.body)

    def stmt_For(self, s):
        it = self.eval(s.iter)
        if isinstance(it, _SYMBOLIC):
            self.fail(s, "for-loop over a tensor or graph", "only loops over known ranges unroll")
        for v in it:
            self.assign(s.target, v)
            self.exec_block(s.body)
        if s.orelse:
            self.exec_block(s.orelse)

    def add_guard(self, s):
        if self.where is not None:
            self.fail(s, f"check '{ast.unparse(s.test)}'", "a check on the data inside a "
                      "user-defined function is not lowered")
        names = sorted({n.id for n in ast.walk(s) if isinstance(n, ast.Name)})
        self.guards.append((ast.unparse(s), names))

    def truth(self, cond, node):
        if isinstance(cond, _SYMBOLIC):
            self.fail(node, "condition on a symbolic value", "cannot decide it before run time")
        return bool(cond)

    # -- expressions -------------------------------------------------------------------------
    def eval(self, e):
        handler = getattr(self, "expr_" + type(e).__name__, None)
        if handler is None:
            self.fail(e, f"expression '{type(e).__name__}'", "not understood by the frontend")
        return handler(e)

    def expr_Constant(self, e):
        return e.value

    def expr_Name(self, e):
        if e.id in self.env:
            return self.env[e.id]
        if e.id in self.globals:
            return self.globals[e.id]
        if hasattr(builtins, e.id):
            return getattr(builtins, e.id)
        self.fail(e, f"name '{e.id}'", "undefined")

    def expr_Tuple(self, e):
        return tuple(self.eval(x) for x in e.elts)

    def expr_Dict(self, e):
        return {self.eval(k): self.eval(v) for k, v in zip(e.keys, e.values)}

    def expr_List(self, e):
        return [self.eval(x) for x in e.elts]

    def expr_JoinedStr(self, e):
        return "<string>"

    def expr_Lambda(self, e):
        return udf.defined_in_source(self, e)

    def expr_IfExp(self, e):
        c = self.eval(e.test)
        return self.eval(e.body if self.truth(c, e) else e.orelse)

    def expr_Attribute(self, e):
        obj = self.eval(e.value)
        if obj is self.module:
            return rules.module_attr(self, e.attr)
        if id(obj) in self.inlined:      # ``self.x`` in a submodule's forward read inline
            return rules.module_attr(self, f"{self.inlined[id(obj)]}.{e.attr}")
        if isinstance(obj, _SYMBOLIC):
            return rules.symbolic_attr(self, obj, e.attr, e)
        if isinstance(obj, torch.nn.Module) and isinstance(obj._parameters.get(e.attr),
                                                           torch.nn.Parameter):
            path = next((n for n, m in self.module.named_modules() if m is obj and n), None)
            if path is not None:         # a submodule's parameter read directly (lin.weight)
                return rules.module_attr(self, f"{path}.{e.attr}")
        try:
            return getattr(obj, e.attr)
        except AttributeError:
            self.fail(e, f"attribute '{e.attr}'", f"not found on {type(obj).__name__}")

    def expr_Subscript(self, e):
        obj = self.eval(e.value)
        key = self.eval(e.slice)
        if isinstance(obj, Frame):
            return rules.frame_get(obj, key, self, e)
        if isinstance(obj, BatchFrame):
            return udf.frame_item(self, obj, key, e)
        if isinstance(obj, _SYMBOLIC) or isinstance(key, _SYMBOLIC):
            return rules.symbolic_index(self, obj, key, e)
        return obj[key]

    def expr_Slice(self, e):
        parts = [self.eval(p) if p is not None else None for p in (e.lower, e.upper, e.step)]
        return slice(*parts)

    def expr_BoolOp(self, e):
        vals = [self.eval(v) for v in e.values]
        if any(isinstance(v, _SYMBOLIC) for v in vals):
            return GraphCondition(source_segment(self.src, e) or "condition")
        if isinstance(e.op, ast.And):
            return all(vals)
        return any(vals)

    def expr_UnaryOp(self, e):
        v = self.eval(e.operand)
        if isinstance(v, _SYMBOLIC):
            if isinstance(e.op, ast.USub) and isinstance(v, Tensor):
                return rules.scale(self, v, -1.0, e)
            return GraphCondition(source_segment(self.src, e) or "condition")
        op = {ast.Not: operator.not_, ast.USub: operator.neg, ast.UAdd: operator.pos,
              ast.Invert: operator.invert}[type(e.op)]
        return op(v)

    def expr_Compare(self, e):
        left = self.eval(e.left)
        result = True
        for op, right_e in zip(e.ops, e.comparators):
            right = self.eval(right_e)
            if isinstance(left, _SYMBOLIC) or isinstance(right, _SYMBOLIC):
                if isinstance(op, (ast.Is, ast.IsNot)):
                    # a symbolic value is never None
                    ok = (left is right) if isinstance(op, ast.Is) else (left is not right)
                    result = result and ok
                else:
                    return GraphCondition(source_segment(self.src, e) or "comparison")
            else:
                result = result and _CMPOPS[type(op)](left, right)
            left = right
        return result

    def expr_BinOp(self, e):
        return self.binop(e.op, self.eval(e.left), self.eval(e.right), e)

    def binop(self, op, a, b, node):
        if not isinstance(a, _SYMBOLIC) and not isinstance(b, _SYMBOLIC):
            return _BINOPS[type(op)](a, b)
        return rules.binop(self, type(op).__name__, a, b, node)

    def expr_Call(self, e):
        func = self.eval(e.func)
        args = []
        for a in e.args:
            if isinstance(a, ast.Starred):
                args.extend(self.eval(a.value))
            else:
                args.append(self.eval(a))
        kwargs = {k.arg: self.eval(k.value) for k in e.keywords if k.arg is not None}
        return self.call(func, args, kwargs, e)

    def call(self, func, args, kwargs, e):
        """``func(*args, **kwargs)``, the call at ``e`` in the source, by the frontend's rules (a
        framework's frontend adds its own calls here)."""
        if isinstance(func, Method):
            return rules.call_method(self, func, args, kwargs, e)
        return rules.call_function(self, func, args, kwargs, e)

    def snapshot(self):
        """What reading a piece of code may add to, to undo it when that piece is not lowered
        (``restore``): the checks, branches, configuration, leaves and functions read."""
        return (list(self.guards), list(self.spec), dict(self.config), dict(self.leaves),
                list(self.udfs), self.heads, self.sites)

    def restore(self, snap):
        (self.guards, self.spec, self.config, self.leaves, self.udfs, self.heads,
         self.sites) = snap

    # -- leaves ------------------------------------------------------------------------------
    def leaf(self, name, rows, cols, kind, sub, source, transposed=False):
        leaf = ir.Leaf(name, rows, cols, kind, sub, source, transposed)
        self.leaves[name] = leaf
        return leaf


def is_tensor_like(x):
    return isinstance(x, (Tensor, torch.Tensor))
