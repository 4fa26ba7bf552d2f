"""Numbers kept per (backend, task): the one shape of the report's scored-episode and progress
tables. A subclass holds `groups` and says how to make an empty group; a group can `absorb` another."""

from __future__ import annotations

from typing import Generic, Protocol, TypeVar

__all__ = ["ByTask", "task_order"]


class _Group(Protocol):
    def absorb(self, other: _Group) -> None: ...


G = TypeVar("G", bound=_Group)


def task_order(task: str) -> tuple[bool, int, str]:
    """Numeric task ids in numeric order, then the others by name."""
    numeric = task.lstrip("-").isdigit()
    return (not numeric, int(task) if numeric else 0, task)


class ByTask(Generic[G]):
    groups: dict[tuple[str, str], G]

    def new_group(self) -> G:
        raise NotImplementedError

    def backends(self) -> list[str]:
        return sorted({backend for backend, _ in self.groups})

    def tasks(self, backend: str) -> list[str]:
        return sorted((task for b, task in self.groups if b == backend), key=task_order)

    def backend_group(self, backend: str) -> G:
        merged = self.new_group()
        for task in self.tasks(backend):
            merged.absorb(self.groups[(backend, task)])
        return merged
