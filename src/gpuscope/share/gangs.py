"""Gang tenants: the ranks of one job, on several GPUs of the node, held as one.

A job that runs collectives across GPUs (NCCL's all-reduce of data-parallel training, the
tensor-parallel ranks of a model server) launches on each GPU a kernel that waits, spinning on the
GPU, until the same collective has been launched on every other GPU. Held on each GPU by that GPU's
turns alone, a rank's collective would spin while its peer waits for its turn elsewhere: the spinning
rank holds its own GPU's turn without progress, and a draining hand-over waits on a kernel that
cannot finish until the other GPU's turn comes (a stall of the drain timeout each time).

A tenant marked ``gang`` in the policy is therefore one group on all its GPUs (its processes on
every GPU of the node are its ranks):

- **One turn everywhere.** Its turns are decided on one GPU, its *lead*: of the GPUs where it has
  processes and shares bind, the one where its share is smallest (then the lowest index), so that
  the turns it takes elsewhere never cut into the other tenants' shares there. On every other GPU
  where shares bind it holds the GPU exactly while it holds its lead: the lead's controller rings
  theirs at each change of its gate, and they drain their own holder and grant the gang at once.
- **One group's demand.** On each of its GPUs the gang counts as active, and as waiting, while any of
  its ranks is, on any GPU: a rank that waits at one gate while its peers are on the host still
  brings the group's turn.
- **No drain, no lending.** A gang's turn is never lent, and it is not drained at its end: a
  collective it queued last may wait for a rank now held elsewhere, and finishes beside the next
  holder when the group's next turn comes. The C turn keeper steps aside on a GPU while a gang has
  processes there (the Python loop hands over, and follows the lead).

What this guarantees: a rank is never held on one GPU while the group holds another (past the
moment it takes a follower to drain its holder, a few accounting windows), so a collective spins
at most until the group's next turn: one turn of the other tenants of its lead. What it does not:
a collective cut by a turn's end is charged to the gang in full, beside the next holder; and a
follower GPU gives the gang its lead's share, not its own (the smallest of its shares is the lead's).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpuscope.share.controller import Controller


@dataclass(frozen=True)
class GangView:
    """What one GPU's controller last saw of its gang tenants: those with processes attached, those
    active, those with a thread held at the gate, and whether shares bind there."""

    attached: frozenset[str] = frozenset()
    active: frozenset[str] = frozenset()
    wanting: frozenset[str] = frozenset()
    binding: bool = False

    def binding_is(self, binding: bool) -> GangView:
        return dataclasses.replace(self, binding=binding)


class Gangs:
    """The gang tenants of a node's controllers, one per GPU (each reads the others' ``gang_view``
    and gate without their locks: each is replaced whole, never changed in place)."""

    def __init__(self, controllers: list[Controller]) -> None:
        self.controllers = controllers

    @staticmethod
    def _slot(c: Controller, name: str) -> int | None:
        for slot, t in enumerate(c.tenants):
            if t.name == name:
                return slot
        return None

    def lead(self, name: str) -> Controller | None:
        """The GPU whose turns gang ``name`` takes everywhere (None: shares bind on none of its GPUs)."""
        best, best_key = None, None
        for c in self.controllers:
            view = c.gang_view
            slot = self._slot(c, name)
            # a GPU whose policy removed the gang (share 0) never leads: its turns there would be none
            if slot is None or name not in view.attached or not view.binding or c.tenants[slot].share <= 0:
                continue
            key = (c.tenants[slot].share, c.gpu.index)
            if best_key is None or key < best_key:
                best, best_key = c, key
        return best

    def holds(self, name: str) -> bool:
        """Whether gang ``name`` may launch on its lead now."""
        lead = self.lead(name)
        if lead is None:
            return True
        slot = self._slot(lead, name)
        return slot is not None and bool(lead._mask & (1 << slot))

    def active_elsewhere(self, name: str, me: Controller) -> bool:
        return any(name in c.gang_view.active for c in self.controllers if c is not me)

    def wanting_elsewhere(self, name: str, me: Controller) -> bool:
        return any(name in c.gang_view.wanting for c in self.controllers if c is not me)

    def _ring_others(self, me: Controller) -> None:
        for c in self.controllers:
            if c is not me and c.gang_view.attached:
                c.policy.ring()

    def gate_changed(self, me: Controller) -> None:
        """``me`` wrote its gate: the GPUs that follow a gang led by it look now."""
        if any(self.lead(name) is me for name in me.gang_view.attached):
            self._ring_others(me)

    def view_changed(self, me: Controller) -> None:
        """``me`` sees its gangs anew (a rank started waiting, went idle, shares began to bind): the
        other GPUs of those gangs look now."""
        self._ring_others(me)
