"""Per-session prefix reuse: finished sessions' KV stays parked in spare cache slots for the next turn.

A multi-turn agent resends its whole context every turn (prompt + sampled turns + tool observations). When a
session finishes, its slot is parked with the exact token sequence whose KV it holds; a later request whose
``prompt_ids`` start with (part of) that sequence takes the slot over and only its new suffix is prefilled.

Invariants:
- A parked slot holds valid KV for exactly ``tokens`` (its ``runner.lens``): the prompt and every sampled
  token except the last one, which was never fed back. Matching is an exact token comparison.
- Reuse takes the longest common prefix with any parked sequence, at least ``MIN_REUSE`` tokens and at most
  ``len(prompt) - 1`` (the last prompt token is always recomputed: its logits start the generation). A prompt
  that diverges inside a parked sequence reuses the common part; the slot is taken over, so the rest of that
  parked sequence is gone. Positions after the common part are overwritten by the suffix prefill.
- The cache has ``max_batch + capacity`` slots. Active sessions occupy ``0..n-1``; parked and claimed slots
  (matched by a queued request, waiting for its prefill batch) always lie at ``n`` or above, so parking never
  reduces active capacity. Beyond ``capacity`` the least recently parked slot is evicted.
- Reuse is exact in the tokens, not in the weights: the owner drops every parked slot on a weight update
  (``drop_all``), so reused KV was always computed by the weights the request runs on (at park time).
"""

from __future__ import annotations

from typing import Any

import numpy as np

MIN_REUSE = 16  # shortest prefix worth reusing (and the length of the lookup key)


class PrefixCache:
    """Parked slots of one runner, their token sequences, and the claims of admitted requests on them."""

    def __init__(self, runner: Any, n_slots: int, capacity: int) -> None:
        self.runner, self.n_slots, self.capacity = runner, n_slots, capacity
        self.parked: dict[int, np.ndarray] = {}  # slot -> tokens whose KV it holds
        self._age: dict[int, int] = {}  # slot -> park stamp (LRU eviction: smallest first)
        self._stamp = 0
        self._index: dict[bytes, dict[int, None]] = {}  # first MIN_REUSE tokens -> slots (ordered set)
        self._claims: dict[int, int] = {}  # claim id -> slot currently holding its KV
        self._next_claim = 0

    def __len__(self) -> int:
        return len(self.parked)

    # ---- bookkeeping -----------------------------------------------------------------------------

    def _add(self, slot: int, tokens: np.ndarray, age: int | None = None) -> None:
        if age is None:
            age, self._stamp = self._stamp, self._stamp + 1
        self.parked[slot], self._age[slot] = tokens, age
        self._index.setdefault(tokens[:MIN_REUSE].tobytes(), {})[slot] = None

    def _pop(self, slot: int) -> np.ndarray:
        tokens = self.parked.pop(slot)
        del self._age[slot]
        key = tokens[:MIN_REUSE].tobytes()
        del self._index[key][slot]
        if not self._index[key]:
            del self._index[key]
        return tokens

    def _free(self, lo: int) -> int:
        """A slot ``>= lo`` holding nothing (highest first, away from where active slots grow)."""
        held = set(self.parked) | set(self._claims.values())
        for slot in range(self.n_slots - 1, lo - 1, -1):
            if slot not in held:
                return slot
        raise RuntimeError(f"no free cache slot at or above {lo}: {len(held)} parked or claimed")

    def _move(self, src: int, dst: int) -> None:
        self.runner.move(src, dst)
        if src in self.parked:
            age = self._age[src]
            self._add(dst, self._pop(src), age)
        else:
            for c, slot in self._claims.items():
                if slot == src:
                    self._claims[c] = dst

    def drop_all(self) -> None:
        """Forget every parked and claimed slot (weight update, engine error, stop)."""
        for slot in [*self.parked, *self._claims.values()]:
            self.runner.release(slot)
        self.parked.clear()
        self._age.clear()
        self._index.clear()
        self._claims.clear()

    # ---- the three operations of the engine ------------------------------------------------------

    def claim(self, prompt: list[int]) -> tuple[int, int] | None:
        """Take the parked slot sharing the longest prefix with ``prompt``: (claim id, reused length)."""
        if self.capacity == 0 or len(prompt) <= MIN_REUSE:
            return None
        p = np.asarray(prompt, dtype=np.int64)
        best: tuple[int, int] | None = None
        for slot in self._index.get(p[:MIN_REUSE].tobytes(), ()):
            a = self.parked[slot]
            m = min(len(a), len(p) - 1)
            diff = np.flatnonzero(a[:m] != p[:m])
            n = int(diff[0]) if len(diff) else m
            if n >= MIN_REUSE and (best is None or n > best[1]):
                best = (slot, n)
        if best is None:
            return None
        self._pop(best[0])
        claim, self._next_claim = self._next_claim, self._next_claim + 1
        self._claims[claim] = best[0]
        return claim, best[1]

    def slot_of(self, claim: int | None) -> int | None:
        """The slot holding ``claim``'s KV now (``None`` for no claim)."""
        return None if claim is None else self._claims[claim]

    def arrange(self, lo: int, claims: list[int | None]) -> list[int]:
        """An order of a prefill batch for slots ``lo..lo+len(claims)-1`` that moves the least KV: a claim
        whose KV already lies in that range goes to its own slot (``place`` then leaves it in place); the
        others fill the remaining positions in their given order. Returns indices into ``claims``."""
        n = len(claims)
        at: list[int | None] = [None] * n
        rest: list[int] = []
        for j, c in enumerate(claims):
            slot = self.slot_of(c)
            if slot is not None and lo <= slot < lo + n and at[slot - lo] is None:
                at[slot - lo] = j
            else:
                rest.append(j)
        others = iter(rest)
        return [j if j is not None else next(others) for j in at]

    def place(self, lo: int, claims: list[int | None]) -> None:
        """Make slots ``lo..lo+len(claims)-1`` ready for a prefill batch.

        Slot ``lo+j`` gets claim ``claims[j]``'s KV, or is emptied of parked/claimed KV when ``None``.
        """
        hi = lo + len(claims)
        at_target = {
            self._claims[c] for j, c in enumerate(claims) if c is not None and self._claims[c] == lo + j
        }
        held = set(self.parked) | set(self._claims.values())
        for slot in range(lo, hi):
            if slot in held and slot not in at_target:
                self._move(slot, self._free(hi))
        for j, c in enumerate(claims):
            if c is not None:
                src = self._claims.pop(c)
                if src != lo + j:
                    self.runner.move(src, lo + j)

    def park(self, slot: int, n_active: int, sequence: list[int], in_place: bool | None = None) -> bool:
        """Keep retiring ``slot``'s KV (``sequence`` = prompt + sampled) where no active session will be.

        ``n_active`` counts the retiring sessions. With ``in_place`` (default: ``slot`` is the last active
        slot) the KV stays in ``slot``, which the caller guarantees ends up at or above the active count once
        the retiring sessions are gone; else it moves to a free slot ``>= n_active``. False (nothing kept)
        when parking is off, the valid prefix is shorter than ``MIN_REUSE``, or every budget entry is
        claimed.
        """
        n_valid = self.runner.lens[slot]
        if self.capacity == 0 or n_valid < MIN_REUSE or not self.runner.can_park(slot):
            return False
        if len(self.parked) + len(self._claims) >= self.capacity:
            if not self.parked:
                return False
            oldest = min(self._age, key=self._age.__getitem__)
            self._pop(oldest)
            self.runner.release(oldest)
        if in_place is None:
            in_place = slot == n_active - 1
        dst = slot if in_place else self._free(n_active)
        if dst != slot:
            self.runner.move(slot, dst)
        self._add(dst, np.asarray(sequence[:n_valid], dtype=np.int64))
        return True
