"""Built-in tools for ``rollout.env.tool.tools`` (``fleetrl.rollout.envs.tools:calc``)."""

from __future__ import annotations

import ast
import operator

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large (at most 64)")
        return _OPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    raise ValueError(f"unsupported expression {ast.dump(node)[:60]}; use numbers, + - * / // % ** and parentheses")


def calc(expression: str) -> str:
    """Evaluate an arithmetic expression (numbers, + - * / // % ** and parentheses) and return the result."""
    value = _eval(ast.parse(str(expression), mode="eval").body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)
