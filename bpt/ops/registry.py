"""Registries of implementations: one per operation that has several (attention, attention
whose shards merge across devices, FLASH's mixed chunk attention, attention over a decode
cache), all of one form.

Each Implementation declares what it takes (why_not: the reason it cannot take these
inputs on this platform, or None) and carries its functions; a Registry resolves a name
once: "auto" by the operation's own choice among the implementations auto may pick, any
other name checked against what it takes, so that nothing is remapped silently. Errors
name the operation and the implementation, never a config key: the caller that read the
setting adds its name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

AUTO = "auto"


def takes_anything(*args, **kwargs) -> None:
    """why_not of an implementation that takes every input on every platform."""
    return None


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One implementation of an operation.

    name:     what a setting calls it.
    takes:    what it supports, in words (dtypes, head_dim, segment ids, GQA, device); the
              docs' tables are made of these lines.
    why_not:  (the operation's inputs) -> the reason it cannot take them here, or None.
    run:      the operation itself, with the registry's signature.
    forward, backward: where the operation's partial results merge (attention over shards):
              (out, lse) of one piece, and that piece's share of the gradient.
    auto:     whether auto may choose it.
    """

    name: str
    takes: str
    why_not: Callable[..., str | None] = takes_anything
    run: Callable | None = None
    forward: Callable | None = None
    backward: Callable | None = None
    auto: bool = True


class Registry:
    """The implementations of one operation and its auto choice.

    choose(*inputs) -> the name auto runs for these inputs (one of the implementations that
    auto may pick and that take them)."""

    def __init__(self, operation: str, implementations: Sequence[Implementation], choose: Callable[..., str]):
        self.operation = operation
        self.implementations = {impl.name: impl for impl in implementations}
        self.choose = choose

    @property
    def names(self) -> tuple[str, ...]:
        """Every name a setting may take: the implementations, then auto."""
        return (*self.implementations, AUTO)

    def __getitem__(self, name: str) -> Implementation:
        """A named implementation (auto stands for none until resolve chooses one)."""
        if self.check(name) == AUTO:
            raise ValueError(f"{self.operation}: 'auto' names no implementation; resolve() chooses one")
        return self.implementations[name]

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def check(self, name: str) -> str:
        """name, or ValueError naming the operation and what it allows."""
        if name not in self.names:
            raise ValueError(f"unknown {self.operation} implementation {name!r}; allowed: {', '.join(self.names)}")
        return name

    def resolve(self, name: str, *inputs, **settings) -> str:
        """The implementation that runs for these inputs: auto's choice, or name itself where
        it takes them (else ValueError with its reason)."""
        if self.check(name) == AUTO:
            chosen = self.choose(*inputs, **settings)
            assert self.implementations[chosen].auto, (self.operation, chosen)
            return chosen
        reason = self.implementations[name].why_not(*inputs, **settings)
        if reason is not None:
            raise ValueError(f"{self.operation} implementation {name!r} cannot run here: {reason}")
        return name

    def table(self) -> str:
        """A markdown table of the implementations and what each takes."""
        rows = [f"| {impl.name} | {impl.takes} |" for impl in self.implementations.values()]
        return "\n".join([f"| {self.operation} | takes |", "|---|---|", *rows])
