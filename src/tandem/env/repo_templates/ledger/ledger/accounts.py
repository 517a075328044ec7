"""Account balances in cents, from a list of postings."""

from __future__ import annotations


class InsufficientFunds(ValueError):
    """A transfer asked for more than the source account holds."""


class Ledger:
    """An append-only list of postings ``(account, cents, memo)``; balances are sums of postings."""

    def __init__(self) -> None:
        self._postings: list[tuple[str, int, str]] = []

    def post(self, account: str, cents: int, memo: str = "") -> None:
        """Record ``cents`` (positive: in, negative: out) on ``account``."""
        if cents == 0:
            raise ValueError("a posting of 0 cents records nothing; pass a non-zero amount")
        self._postings.append((account, cents, memo))

    def balance(self, account: str) -> int:
        return sum(c for a, c, _ in self._postings if a == account)

    def transfer(self, src: str, dst: str, cents: int, memo: str = "transfer") -> None:
        """Move ``cents`` (> 0) from ``src`` to ``dst``; InsufficientFunds when ``src`` holds less."""
        if src == dst:
            raise ValueError(f"cannot transfer from {src!r} to itself")
        if cents <= 0:
            raise ValueError(f"transfer amount must be positive, got {cents}")
        if self.balance(src) < cents:
            raise InsufficientFunds(f"{src!r} holds {self.balance(src)} cents, {cents} needed")
        self.post(src, -cents, memo)
        self.post(dst, cents, memo)

    def statement(self, account: str) -> list[tuple[str, int, int]]:
        """``(memo, cents, balance after it)`` for every posting on ``account``, oldest first."""
        out = []
        running = 0
        for a, c, memo in self._postings:
            if a == account:
                running += c
                out.append((memo, c, running))
        return out

    def accounts(self) -> list[str]:
        """Every account with at least one posting, sorted."""
        return sorted({a for a, _, _ in self._postings})
