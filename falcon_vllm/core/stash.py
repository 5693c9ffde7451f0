"""Per-request stash of the last k-1 drafter inputs, for the relaxed block of the next step.

The relaxed block of a step is the last k committed drafter positions of a request.  When the
target just verified fewer than k new positions (``accepted + 1 < k``, the common case at low
acceptance), the older rows of that block were fed to the drafter in an earlier step, and their
inputs (token ``x_{j+1}``, target feature ``f_j``) are no longer in the runner's buffers.  This
stash keeps them: after every step, the last k-1 rows of each request's block.

Rows are keyed by position, so a stale entry (a request that was not scheduled for a while, a
prefix-cache hit) is simply not used; committed positions never change their inputs, so a row is
valid whenever its position precedes the current chunk.  Storage is one preallocated tensor per
field, indexed by a slot per request (LRU-evicted), so lookups and updates are gathers/scatters
without host synchronisation.

It also holds each request's *pending* chunk rows: verified rows whose drafter K/V a step served by prompt
lookup alone (``FalconProposer.defer_chunk``) or a step with drafting off (``FalconProposer.gap_rows``) did not
write; the next drafter pass runs them first.  They are kept as the steps left them, a list of consecutive
pieces per request, and joined once, when a pass takes them.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class BlockInputStash:
    def __init__(self, num_slots: int, k: int, hidden_size: int, device, dtype, ids_dtype=torch.int32):
        self.k = k
        self.num_slots = num_slots
        rows = max(k - 1, 1)
        # slot num_slots is a scratch slot for batch rows without a request id (never valid)
        self.ids = torch.zeros(num_slots + 1, rows, dtype=ids_dtype, device=device)          # [S+1, k-1]
        self.feats = torch.zeros(num_slots + 1, rows, hidden_size, dtype=dtype, device=device)  # [S+1, k-1, H]
        self.end_pos = torch.full((num_slots + 1,), -1, dtype=torch.long, device=device)  # position of the last row
        self.num_valid = torch.zeros(num_slots + 1, dtype=torch.long, device=device)      # valid rows, from the end
        self._slot_of: OrderedDict[str, int] = OrderedDict()
        self._free = list(range(num_slots))
        # slot -> pieces (ids [n], feats [n, H], level offsets [n], first position), each at consecutive positions
        # following the one before, oldest first; a row's level offset is taken from its request's end when it was
        # verified, as a pass then would
        self.pending: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]]] = {}
        # slots whose pending rows were dropped unrun since the owner last drained them (their drafter K/V has a
        # gap: FalconProposer.note_drops marks those requests)
        self.dropped: set[int] = set()

    def drain_dropped(self) -> list[str]:
        """The requests whose pending rows were dropped unrun since the last call."""
        owners = {s: r for r, s in self._slot_of.items()}
        out = [owners[s] for s in self.dropped if s in owners]
        self.dropped.clear()
        return out

    def _drop(self, slot: int) -> None:
        if self.pending.pop(slot, None) is not None:
            self.dropped.add(slot)

    def slots(self, req_ids: list[str | None], device) -> torch.Tensor:
        """Slot index per batch row [B] (new requests get a fresh, empty slot)."""
        out = []
        fresh = []
        for r in req_ids:
            if r is None:
                out.append(self.num_slots)
                continue
            s = self._slot_of.get(r)
            if s is None:
                if not self._free:  # evict the least recently used request
                    _, old = self._slot_of.popitem(last=False)
                    self._free.append(old)
                s = self._free.pop()
                self._slot_of[r] = s
                fresh.append(s)
            else:
                self._slot_of.move_to_end(r)
            out.append(s)
        for s in fresh:  # a fresh request, or an evicted one's slot: whatever it held is not this request's
            self.pending.pop(s, None)
            self.dropped.discard(s)
        if fresh:
            self.num_valid[torch.tensor(fresh, device=self.num_valid.device)] = 0
        return torch.tensor(out, dtype=torch.long, device=device)

    def fill(self, slots, ids, feats, positions, known) -> torch.Tensor:
        """Fill the unknown rows of a block from the stash, in place.

        slots [B]; ids [B, k]; feats [B, k, H]; positions [B, k] (may be < 0 before the sequence
        start); known [B, k] bool.  Returns the updated ``known``.
        """
        back = self.end_pos[slots][:, None] - positions                 # [B, k] rows back from the stash end
        usable = (~known) & (positions >= 0) & (back >= 0) & (back < self.num_valid[slots][:, None])
        row = (self.ids.shape[1] - 1 - back).clamp(0, self.ids.shape[1] - 1)  # [B, k] stash row index
        s = slots[:, None].expand_as(row)
        ids.copy_(torch.where(usable, self.ids[s, row].to(ids.dtype), ids))
        feats.copy_(torch.where(usable[..., None], self.feats[s, row].to(feats.dtype), feats))
        # keep only the contiguous suffix (a stash that ends before the chunk leaves a gap)
        return (known | usable).flip(1).long().cumprod(1).flip(1).bool()

    def update(self, slots, ids, feats, positions, known) -> None:
        """Remember the last k-1 rows of each request's block (known rows are a suffix)."""
        if self.k < 2:
            return
        self.ids[slots] = ids[:, 1:].to(self.ids.dtype)
        self.feats[slots] = feats[:, 1:].to(self.feats.dtype)
        self.end_pos[slots] = positions[:, -1].long()
        self.num_valid[slots] = known[:, 1:].long().sum(1)

    def retain(self, slots: list[int]) -> None:
        """Drop the pending rows of requests outside this step (finished, or left out of this step: ``dropped``)."""
        for s in set(self.pending).difference(slots):
            self._drop(s)

    def num_rows(self, slot: int) -> int:
        """The pending rows of ``slot``."""
        return sum(len(piece[0]) for piece in self.pending.get(slot, ()))

    def total_rows(self, slots) -> int:
        """The pending rows of all of ``slots``."""
        return sum(self.num_rows(s) for s in set(slots))

    def max_rows(self) -> int:
        """The most pending rows any request holds."""
        return max((self.num_rows(s) for s in self.pending), default=0)

    def _end(self, slot: int) -> int | None:
        """The position after ``slot``'s last pending row (None: none pending)."""
        pieces = self.pending.get(slot)
        return pieces[-1][3] + len(pieces[-1][0]) if pieces else None

    def defer(self, slots: list[int], rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]],
              cap: int) -> bool:
        """Append each request's verified rows (ids [n], feats [n, H], offsets [n], first position) to its pending
        rows, unless one would then hold more than ``cap`` (returns False, nothing changed).  Rows that do not follow
        a request's pending rows replace them: the old ones are dropped, their K/V left unwritten, as after a step that
        drafts nothing (only acceptance can suffer)."""
        merged = []
        for s, piece in zip(slots, rows):
            follows = self._end(s) == piece[3]
            if len(piece[0]) + (self.num_rows(s) if follows else 0) > cap:
                return False
            merged.append((s, self.pending[s] + [piece] if follows else [piece]))
        for s, pieces in merged:
            if s in self.pending and len(pieces) == 1:  # replaced: the old rows stay unwritten
                self.dropped.add(s)
        self.pending.update(merged)
        return True

    def keep(self, slot: int, piece: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int], cap: int) -> bool:
        """Append one request's verified rows of a step with drafting off to its pending rows.  False, and its pending
        rows dropped, when they do not follow the pending rows it has or would exceed ``cap``: its drafter K/V then
        has a gap."""
        follows = self._end(slot) in (None, piece[3])
        if not follows or len(piece[0]) + self.num_rows(slot) > cap:
            self._drop(slot)  # (the caller marks the request: keep returned False)
            return False
        self.pending.setdefault(slot, []).append(piece)
        ids, feats, first = piece[0], piece[1], piece[3]
        R, n = self.ids.shape[1], min(self.ids.shape[1], len(ids))  # the stash's rows: the last k-1 verified ones
        if self.k > 1 and n:  # (this path runs on CPU only: reading the stash's tensors costs no device sync)
            old = min(R - n, int(self.num_valid[slot])) if int(self.end_pos[slot]) == first - 1 else 0
            if old:  # rows it holds that precede these move up
                self.ids[slot, R - n - old:R - n] = self.ids[slot, R - old:].clone()
                self.feats[slot, R - n - old:R - n] = self.feats[slot, R - old:].clone()
            self.ids[slot, R - n:] = ids[-n:].to(self.ids.device, self.ids.dtype)
            self.feats[slot, R - n:] = feats[-n:].to(self.feats.device, self.feats.dtype)
            self.end_pos[slot] = first + len(ids) - 1
            self.num_valid[slot] = n + old
        return True

    def take(self, slots: list[int], chunk_start: list[int], block_start: list[int]):
        """Each batch row's pending rows that end where its chunk starts, cut before its relaxed block
        (``block_start``); the rest are dropped.  Returns (batch row [P], ids [P], feats [P, H], offsets [P],
        positions [P]) of the rows to run, or None; every slot's pending rows are cleared."""
        out = []
        for b, (s, c, e) in enumerate(zip(slots, chunk_start, block_start)):
            if self._end(s) != c:  # rows that do not meet the chunk cannot run causally before it
                self._drop(s)
                continue
            pieces = self.pending.pop(s)
            ids, feats, offs = (torch.cat([p[i] for p in pieces]) for i in range(3))
            first = pieces[0][3]
            n = max(0, min(len(ids), e - first))
            if n:
                out.append((b, ids[:n], feats[:n], offs[:n], first))
        if not out:
            return None
        req = torch.cat([torch.full((len(r[1]),), r[0], dtype=torch.long) for r in out])
        pos = torch.cat([torch.arange(r[4], r[4] + len(r[1])) for r in out])
        return (req, *(torch.cat([r[i] for r in out]) for i in (1, 2, 3)), pos)
