"""A cell's place in a quorum: the alive cells of quorum ``quorum_id``, and where this cell stands among them.

The group hands one to every rank with each ``init`` and ``reconfigure``; the rank trains, reduces and
heals in that quorum until the next one.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class IndepDPInfo:
    """A cell's place in the current quorum."""

    cell_index: int
    num_cells: int
    alive_rank: int
    alive_size: int
    quorum_id: int
    alive_cell_indices: tuple[int, ...]

    def __post_init__(self) -> None:
        assert self.alive_rank == self.alive_cell_indices.index(self.cell_index)
        assert self.alive_size == len(self.alive_cell_indices)

    @classmethod
    def for_cell(cls, cell_index: int, num_cells: int, quorum_id: int, alive: list[int]) -> "IndepDPInfo":
        return cls(cell_index, num_cells, alive.index(cell_index), len(alive), quorum_id, tuple(alive))
