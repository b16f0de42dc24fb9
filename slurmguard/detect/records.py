"""Inputs of the detectors, independent of the ring format.

The node agent turns ring records into these (one RankOps per rank, in the
order the rank issued its collectives); tests and the benchmark build them
directly. Times are integer nanoseconds on one clock per node (the hook's host
timestamps); an op still in flight has end_ns == 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from slurmguard.errors import InputError
from slurmguard.slurm import hostlist

IN_FLIGHT = 0  # end_ns of an op that has not completed


@dataclass(frozen=True, eq=False)
class RankOps:
    """The collective ops of one rank, in issue order.

    op: integer op-type codes (any stable coding: AllReduce=0, AllGather=1, ...).
    comm: communicator ids (same id on every rank of one communicator).
    nbytes: message size in bytes. start_ns/end_ns: host timestamps, ns;
    end_ns == 0 while the op is in flight.
    """

    rank: int
    op: np.ndarray
    comm: np.ndarray
    nbytes: np.ndarray
    start_ns: np.ndarray
    end_ns: np.ndarray

    def __post_init__(self) -> None:
        cols = {
            "op": self.op,
            "comm": self.comm,
            "nbytes": self.nbytes,
            "start_ns": self.start_ns,
            "end_ns": self.end_ns,
        }
        n = None
        for name, arr in cols.items():
            a = np.asarray(arr)
            if a.ndim != 1:
                raise InputError(f"rank {self.rank}: column {name} must be 1-D, got shape {a.shape}")
            if n is None:
                n = a.size
            elif a.size != n:
                raise InputError(f"rank {self.rank}: column {name} has {a.size} rows, expected {n}")
            object.__setattr__(self, name, a.astype(np.int64, copy=False))

    def __len__(self) -> int:
        return int(self.op.size)

    @property
    def completed(self) -> np.ndarray:
        return self.end_ns != IN_FLIGHT

    @classmethod
    def from_rows(cls, rank: int, rows: list[tuple[int, int, int, int, int]]) -> RankOps:
        """Build from (op, comm, nbytes, start_ns, end_ns) tuples."""
        a = np.asarray(rows, dtype=np.int64).reshape(-1, 5)
        return cls(rank, a[:, 0], a[:, 1], a[:, 2], a[:, 3], a[:, 4])


@dataclass(frozen=True)
class RankPlace:
    """Where a rank runs: node name, local GPU index, optional NIC name."""

    rank: int
    node: str
    gpu: int | None = None
    nic: str | None = None


class JobLayout:
    """rank -> (node, GPU) for one job, from ring headers or the Slurm layout."""

    def __init__(self, job_id: str, places: list[RankPlace]) -> None:
        self.job_id = str(job_id)
        self._by_rank: dict[int, RankPlace] = {}
        for p in places:
            if p.rank in self._by_rank:
                raise InputError(f"job {job_id}: rank {p.rank} placed twice")
            self._by_rank[p.rank] = p

    @property
    def ranks(self) -> list[int]:
        return sorted(self._by_rank)

    @property
    def nodes(self) -> list[str]:
        seen: dict[str, None] = {}
        for r in self.ranks:
            seen.setdefault(self._by_rank[r].node, None)
        return list(seen)

    def place(self, rank: int) -> RankPlace:
        try:
            return self._by_rank[rank]
        except KeyError:
            raise InputError(f"job {self.job_id}: rank {rank} is not in the job layout") from None

    def node_of(self, rank: int) -> str:
        return self.place(rank).node

    def gpu_of(self, rank: int) -> int | None:
        return self.place(rank).gpu

    def ranks_on(self, node: str) -> list[int]:
        return [r for r in self.ranks if self._by_rank[r].node == node]

    @classmethod
    def from_headers(cls, job_id: str, headers: list[tuple[int, str, int | None]]) -> JobLayout:
        """From ring headers: (rank, hostname, cuda device index) per ring."""
        return cls(job_id, [RankPlace(r, h, g) for r, h, g in headers])

    @classmethod
    def from_slurm(
        cls,
        job_id: str,
        nodelist: str,
        tasks_per_node: str,
        distribution: str = "block",
        gpus_per_node: int | None = None,
    ) -> JobLayout:
        """From SLURM_JOB_NODELIST and SLURM_TASKS_PER_NODE (e.g. "2(x3),1").

        Block distribution fills each node in turn (Slurm's default); cyclic
        deals ranks round-robin. The local rank is the GPU index when each task
        owns one GPU (the usual `--gpus-per-task=1` layout); with
        `gpus_per_node`, local ranks beyond it get no GPU.
        """
        nodes = hostlist.expand(nodelist)
        counts = parse_tasks_per_node(tasks_per_node)
        if len(counts) != len(nodes):
            raise InputError(
                f"job {job_id}: SLURM_TASKS_PER_NODE '{tasks_per_node}' describes "
                f"{len(counts)} nodes, nodelist '{nodelist}' has {len(nodes)}"
            )
        places: list[RankPlace] = []
        if distribution == "block":
            rank = 0
            for node, c in zip(nodes, counts):
                for lr in range(c):
                    gpu = lr if gpus_per_node is None or lr < gpus_per_node else None
                    places.append(RankPlace(rank, node, gpu))
                    rank += 1
        elif distribution == "cyclic":
            left = list(counts)
            local = [0] * len(nodes)
            rank = 0
            while any(left):
                for i, node in enumerate(nodes):
                    if left[i]:
                        g = local[i] if gpus_per_node is None or local[i] < gpus_per_node else None
                        places.append(RankPlace(rank, node, g))
                        local[i] += 1
                        left[i] -= 1
                        rank += 1
        else:
            raise InputError(f"job {job_id}: unknown task distribution '{distribution}'")
        return cls(job_id, places)


def parse_tasks_per_node(spec: str) -> list[int]:
    """SLURM_TASKS_PER_NODE: "2(x3),1" -> [2, 2, 2, 1]."""
    out: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        try:
            if "(x" in part:
                n, rep = part.split("(x")
                out.extend([int(n)] * int(rep.rstrip(")")))
            else:
                out.append(int(part))
        except ValueError:
            raise InputError(f"SLURM_TASKS_PER_NODE: cannot parse '{part}' in '{spec}'") from None
    return out
