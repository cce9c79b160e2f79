"""Integer expressions over + - * ( ): the parser behind countdown's reward and format check.

Never evaluates Python code: a tokenizer plus recursive descent over a fixed grammar, with bounds
on length and nesting depth.
"""

from __future__ import annotations

import re

_TOKEN = re.compile(r"\s*(?:([0-9]+)|([-+*()]))")
_MAX_EXPR_CHARS, _MAX_DEPTH = 256, 32


class _Malformed(Exception):
    pass


class _ExprParser:
    """expr := term (('+'|'-') term)* ; term := factor ('*' factor)* ;
    factor := NUMBER | '(' expr ')'. No unary minus, no leading zeros ("07")."""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens, self.i, self.depth, self.numbers = tokens, 0, 0, []

    def peek(self) -> str | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self) -> str:
        tok = self.peek()
        if tok is None:
            raise _Malformed("unexpected end")
        self.i += 1
        return tok

    def expr(self) -> int:
        value = self.term()
        while self.peek() in ("+", "-"):
            value = value + self.term() if self.take() == "+" else value - self.term()
        return value

    def term(self) -> int:
        value = self.factor()
        while self.peek() == "*":
            self.take()
            value *= self.factor()
        return value

    def factor(self) -> int:
        tok = self.take()
        if tok == "(":
            self.depth += 1
            if self.depth > _MAX_DEPTH:
                raise _Malformed("nested too deep")
            value = self.expr()
            if self.take() != ")":
                raise _Malformed("expected ')'")
            self.depth -= 1
            return value
        if not tok.isdigit() or (len(tok) > 1 and tok[0] == "0"):
            raise _Malformed(f"unexpected {tok!r}")
        self.numbers.append(int(tok))
        return int(tok)


def parse_expression(text: str) -> tuple[int, list[int]] | None:
    """(value, numbers used in order) of an integer expression over + - * ( ); None if malformed.

    Never evaluates Python code: a tokenizer plus recursive descent over a fixed grammar.
    """
    text = text.strip()
    if not text or len(text) > _MAX_EXPR_CHARS:
        return None
    tokens, pos = [], 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            return None
        tokens.append(m.group(1) or m.group(2))
        pos = m.end()
    parser = _ExprParser(tokens)
    try:
        value = parser.expr()
    except _Malformed:
        return None
    if parser.i != len(tokens):
        return None
    return value, parser.numbers
