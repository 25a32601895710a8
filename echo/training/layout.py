"""Where each rank sits in the parallel mesh, and the process groups it belongs to.

Rank order follows Megatron-LM: tensor-parallel ranks are adjacent (so a TP group shares a
node's NVLink), then context, then data, then pipeline outermost:
    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))
"""

from __future__ import annotations

from dataclasses import dataclass

from echo.config.workload import ParallelConfig, model_stages


@dataclass(frozen=True)
class Coords:
    """A rank's position in the mesh."""

    pp: int
    dp: int
    cp: int
    tp: int


@dataclass(frozen=True)
class ChunkSlot:
    """One model chunk of a pipeline rank: which layers it holds and its ends of the model."""

    layers: range  # global layer indices
    first: bool    # holds the token embedding
    last: bool     # holds the final norm, the head and the loss


def chunk_slots(parallel: ParallelConfig, layers: int, pp_rank: int) -> list[ChunkSlot]:
    """The chunks of pipeline rank ``pp_rank``, one per virtual stage (``parallel.virtual_stage``:
    interleaved, chunk c holds virtual stage c * pp + pp_rank; a V, the zero-bubble ZB-V's), with
    ``stage_layers`` respected."""
    counts, v = parallel.layers_of(layers), parallel.virtual_stages
    starts = [sum(counts[:i]) for i in range(len(counts))]
    out = []
    for c in range(v):
        k = parallel.virtual_stage(c, pp_rank)
        out.append(ChunkSlot(range(starts[k], starts[k] + counts[k]), first=k == 0, last=k == len(counts) - 1))
    return out


@dataclass(frozen=True)
class Layout:
    """The job's mesh: rank <-> coordinates, and each rank's groups."""

    parallel: ParallelConfig

    @property
    def sizes(self) -> dict[str, int]:
        p = self.parallel
        return {"pp": p.pp, "dp": p.dp, "cp": p.cp, "tp": p.tp}

    @property
    def world_size(self) -> int:
        return self.parallel.world_size

    def rank(self, c: Coords) -> int:
        s = self.sizes
        return c.tp + s["tp"] * (c.cp + s["cp"] * (c.dp + s["dp"] * c.pp))

    def coords(self, rank: int) -> Coords:
        s = self.sizes
        tp, rest = rank % s["tp"], rank // s["tp"]
        cp, rest = rest % s["cp"], rest // s["cp"]
        dp, pp = rest % s["dp"], rest // s["dp"]
        return Coords(pp=pp, dp=dp, cp=cp, tp=tp)

    def group(self, rank: int, dim: str) -> list[int]:
        """Global ranks of ``rank``'s group along mesh dimension ``dim`` (tp, cp, dp or pp), or
        "dpcp": the data- and context-parallel ranks, which hold the same parameters; "stage": the
        ranks of its pipeline stage; "world": every rank."""
        c = self.coords(rank)
        if dim == "world":  # every rank (the gradient norm's all-reduce)
            return list(range(self.world_size))
        if dim == "dpcp":
            return sorted(r for d in self.group(rank, "dp") for r in self.group(d, "cp"))
        if dim == "stage":  # every rank of the pipeline stage: tp x cp x dp (FP8 amax reduction)
            return sorted(r for d in self.group(rank, "dpcp") for r in self.group(d, "tp"))
        return [self.rank(Coords(**{**c.__dict__, dim: i})) for i in range(self.sizes[dim])]

    def expert_group(self, rank: int, dim: str) -> list[int]:
        """Expert parallelism folded over the tp x cp x dp ranks of a pipeline stage, as
        Megatron-Core lays it out (MoE parallel folding, expert tensor parallel size 1): in the
        stage's rank order, ``ep`` consecutive ranks share out the experts (dim "ep"; TP peers hold
        different sequence shards, so they exchange tokens like any other), and the ranks holding
        the same experts reduce their gradients together (dim "edp", tp x cp x dp / ep of them).
        So ep may exceed dp (DeepSeek-V3's TP2 x DP32 with EP64)."""
        s, ep = self.sizes, self.parallel.ep
        stage = s["tp"] * s["cp"] * s["dp"]
        base, local = divmod(rank, stage)
        if dim == "ep":
            members = [(local // ep) * ep + i for i in range(ep)]
        else:
            members = [local % ep + j * ep for j in range(stage // ep)]
        return [base * stage + m for m in members]

    def all_groups(self, dim: str) -> list[list[int]]:
        """Every group along ``dim``, each once, in order of its first rank."""
        seen: dict[int, list[int]] = {}
        for r in range(self.world_size):
            g = self.group(r, dim)
            seen.setdefault(g[0], g)
        return list(seen.values())

    def stage_peer(self, rank: int, step: int) -> int | None:
        """The rank ``step`` pipeline stages away (same tp/cp/dp coordinates), or None."""
        c = self.coords(rank)
        pp = c.pp + step
        if not 0 <= pp < self.sizes["pp"]:
            return None
        return self.rank(Coords(pp=pp, dp=c.dp, cp=c.cp, tp=c.tp))

    def chunk_peer(self, rank: int, chunk: int, step: int, virtual_stages: int) -> int | None:
        """The rank holding the virtual stage ``step`` away from ``rank``'s chunk ``chunk``
        (interleaving wraps around the pipeline, a V turns at the last rank), or None past either
        end."""
        p = self.parallel
        stage = p.virtual_stage(chunk, self.coords(rank).pp) + step
        if not 0 <= stage < model_stages(p.placement, p.pp, virtual_stages):
            return None
        # dual: the next stage on this chunk's way (the two ways hold the same stages on other ranks)
        return self.stage_peer(rank, p.rank_of_stage(stage, chunk)[0] - self.coords(rank).pp)

    def mirror(self, rank: int) -> int:
        """The rank holding the other copy of this rank's stages under DualPipe (pipeline rank
        pp - 1 - s, same tp/cp/dp coordinates)."""
        pp = self.coords(rank).pp
        return self.stage_peer(rank, self.sizes["pp"] - 1 - 2 * pp)

    def representatives(self) -> dict[str, int]:
        """One traced rank per role: ranks of a role differ only in which group peers they have.

        Roles today are pipeline stages; the first and last stage carry embedding and loss.
        """
        return {f"pp{s}": self.rank(Coords(pp=s, dp=0, cp=0, tp=0)) for s in range(self.sizes["pp"])}

    def role_of(self, rank: int) -> str:
        return f"pp{self.coords(rank).pp}"
