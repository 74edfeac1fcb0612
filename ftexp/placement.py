"""Where each rank runs in a multi-node job: cells (and baseline ranks) laid out over the nodes.

Pure arithmetic, shared by the launcher (which starts one Ray node per Slurm node), the trainer
(which pins each cell's ranks to their nodes with a placement group) and the scenarios (which
derive what a node fault must do from the plan). A node holds ``ranks_per_node`` ranks: the
mode's ``train_gpus_per_node`` on GPUs, ``train_cpus_per_node`` on CPUs, or, when that is 0, the
ranks spread evenly over the nodes. Cells fill the nodes in order, whole cells per node; a cell
straddles nodes only when it has more ranks than a node holds. Node 0 is the head: it also runs
the driver (and the TCPStore), so a node fault may take any node but that one.
"""

from __future__ import annotations

from dataclasses import dataclass

from ftexp.errors import InputError


def node_resource(node: int) -> str:
    """The Ray custom resource that marks node ``node`` (placement-group bundles ask for it)."""
    return f"node{node}"


@dataclass(frozen=True)
class Placement:
    nodes: int
    ranks_per_node: int
    rank_nodes: tuple[tuple[int, ...], ...]  # [cell][rank within cell] -> node

    @classmethod
    def build(cls, num_cells: int, ranks_per_cell: int, nodes: int, ranks_per_node: int = 0) -> "Placement":
        """Lay ``num_cells`` cells of ``ranks_per_cell`` ranks over ``nodes`` nodes; InputError if they do not fit."""
        if nodes < 1:
            raise InputError(f"nodes={nodes}: a job needs at least one node")
        total = num_cells * ranks_per_cell
        per_node = ranks_per_node or -(-total // nodes)
        if total > nodes * per_node:
            raise InputError(f"{num_cells} cells x {ranks_per_cell} ranks = {total} ranks do not fit on {nodes} "
                             f"node(s) of {per_node} ranks")
        if ranks_per_cell <= per_node:  # whole cells per node
            cells_per_node = per_node // ranks_per_cell
            if num_cells > nodes * cells_per_node:
                raise InputError(f"{num_cells} cells of {ranks_per_cell} ranks do not fit whole on {nodes} node(s) of "
                                 f"{per_node} ranks ({cells_per_node} cell(s) per node)")
            layout = tuple((c // cells_per_node,) * ranks_per_cell for c in range(num_cells))
        else:  # a cell needs more ranks than a node holds: it spans consecutive nodes
            layout = tuple(tuple((c * ranks_per_cell + r) // per_node for r in range(ranks_per_cell))
                           for c in range(num_cells))
        return cls(nodes, per_node, layout)

    @classmethod
    def single_node(cls, num_cells: int, ranks_per_cell: int) -> "Placement":
        return cls(1, num_cells * ranks_per_cell, tuple((0,) * ranks_per_cell for _ in range(num_cells)))

    @property
    def multi_node(self) -> bool:
        return self.nodes > 1

    def cell_nodes(self, cell: int) -> list[int]:
        """The nodes cell ``cell`` runs on (one, unless it straddles)."""
        return sorted(set(self.rank_nodes[cell]))

    def cells_on(self, node: int) -> list[int]:
        """The cells with at least one rank on ``node``: all of them are lost when the node is."""
        return [c for c, ranks in enumerate(self.rank_nodes) if node in ranks]

    def first_rank_on(self, node: int) -> tuple[int, int] | None:
        """(cell, rank) of the first rank placed on ``node``: the one that takes the node down in a planned fault."""
        return next(((c, r) for c, ranks in enumerate(self.rank_nodes) for r, n in enumerate(ranks) if n == node), None)

    def baseline_ranks_on(self, node: int) -> list[int]:
        """The baseline's global ranks on ``node``: the world's ranks in consecutive blocks per node, as the
        target's cells fill the nodes (same number of ranks on each node as the target)."""
        counts = [sum(ranks.count(n) for ranks in self.rank_nodes) for n in range(self.nodes)]
        start = sum(counts[:node])
        return list(range(start, start + counts[node]))


def job_nodes(cfg) -> int:
    """How many nodes the training jobs of ``cfg`` (an ExperimentConfig) get: ``launcher.nodes``, or more if the
    mode needs more train nodes. A local launcher is one machine."""
    launcher = getattr(cfg, "launcher", None)  # (a config without a launcher: one machine)
    if launcher is None or launcher.name.value != "slurm":
        return 1
    return max(launcher.nodes, cfg.mode.nodes)


def placement_for(cfg) -> Placement | None:
    """The layout of ``cfg``'s cells over its job's nodes; None for a one-node job."""
    nodes = job_nodes(cfg)
    if nodes <= 1:
        return None
    mode = cfg.mode
    per_node = mode.train_gpus_per_node if cfg.launcher.gpus_per_node else mode.train_cpus_per_node
    return Placement.build(mode.num_cells, mode.ranks_per_cell, nodes, per_node)
