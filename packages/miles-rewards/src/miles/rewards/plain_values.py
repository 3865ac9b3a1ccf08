"""Values out of an untrusted program, as plain data, so the verdict on them is reached outside it.

An assert-style test (`assert solve(3) == 9`) run inside the program's own process can be voted
through by what the program returns: an object whose `__eq__` is always true passes every
case. Here the sandboxed process only computes the test's operands and prints them through
`dump`, a serializer defined before the program's code runs (its builtins captured then), that
accepts plain built-in values only, by exact type (no subclasses, no custom objects), as a
Python literal. The comparison runs in the reward's own process, on the decoded values
(`load`): `==` on ints, floats, strings, lists, tuples, dicts and sets, which no program
defines. A literal right-hand side (`== 9`) is not even shown to the program.

What this does not prevent (docs/sandbox.md): the program shares its process with the harness,
so one that reads its own source (`solution.py`), finds the harness and prints a forged line, or
patches the harness through frame introspection, still wins; so does one that special-cases the
visible test inputs. It stops a returned object from voting for itself, not a program that
attacks the harness on purpose.
"""

from __future__ import annotations

import ast
import math
from typing import Any

# Nesting the serializer follows before it gives up (a deeper value is not plain data).
MAX_DEPTH = 64


def dump_source(name: str) -> str:
    """Python source defining `name(value) -> str`: the value as a tagged literal, or TypeError
    for anything but exact built-in plain types. Its builtins are bound as defaults when the
    definition runs, so it must run before the program's code."""
    return f"""
def {name}(
    value, _depth=0, _type=type, _repr=repr, _tuple=tuple, _sorted=sorted, _str=str,
    _int=int, _float=float, _bool=bool, _bytes=bytes, _list=list, _dict=dict, _set=set,
    _frozenset=frozenset, _none=type(None), _error=TypeError,
):
    def tagged(x, depth):
        if depth > {MAX_DEPTH}:
            raise _error("nested too deep to be plain data")
        t = _type(x)
        if t is _none:
            return ("n",)
        if t is _bool:
            return ("b", x)
        if t is _int:
            return ("i", x)
        if t is _float:
            return ("f", _repr(x))
        if t is _str:
            return ("s", x)
        if t is _bytes:
            return ("y", x)
        if t is _list or t is _tuple or t is _set or t is _frozenset:
            tag = "l" if t is _list else "t" if t is _tuple else "S" if t is _set else "F"
            return (tag, _tuple(tagged(v, depth + 1) for v in x))
        if t is _dict:
            return ("d", _tuple((tagged(k, depth + 1), tagged(v, depth + 1)) for k, v in x.items()))
        raise _error("not plain data: " + _repr(t))

    return _repr(tagged(value, _depth))
"""


def load(text: str) -> Any:
    """The value `dump` printed as `text` (ValueError if it is not such a literal)."""
    return _decode(ast.literal_eval(text.strip()))


def _decode(node: Any) -> Any:
    if not isinstance(node, tuple) or not node or not isinstance(node[0], str):
        raise ValueError(f"not a dumped value: {node!r}"[:200])
    tag = node[0]
    if tag == "n":
        return None
    if tag in ("b", "i", "s", "y"):
        return node[1]
    if tag == "f":
        return float(node[1])  # repr of a float, 'nan' and 'inf' included
    if tag in ("l", "t", "S", "F"):
        items = [_decode(v) for v in node[1]]
        kinds = {"l": list, "t": tuple, "S": set, "F": frozenset}
        return kinds[tag](items)
    if tag == "d":
        return {_decode(k): _decode(v) for k, v in node[1]}
    raise ValueError(f"unknown tag {tag!r}")


def same(a: Any, b: Any) -> bool:
    """Python's `==` on plain values, except that NaN equals NaN at the same place (a program
    that answers NaN where NaN is expected is right)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if type(a) in (list, tuple) and type(a) is type(b):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)
