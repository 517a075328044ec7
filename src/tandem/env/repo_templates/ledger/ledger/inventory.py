"""Stock levels per SKU."""

from __future__ import annotations


class Inventory:
    """Quantities in stock per SKU; a SKU whose stock reaches zero is no longer listed."""

    def __init__(self) -> None:
        self._stock: dict[str, int] = {}

    def add(self, sku: str, qty: int) -> int:
        """Put ``qty`` (> 0) of ``sku`` into stock; returns the new level."""
        if qty <= 0:
            raise ValueError(f"quantity must be positive, got {qty}")
        self._stock[sku] = self._stock.get(sku, 0) + qty
        return self._stock[sku]

    def remove(self, sku: str, qty: int) -> int:
        """Take ``qty`` (> 0) of ``sku`` out of stock; returns the new level (ValueError: too few left)."""
        if qty <= 0:
            raise ValueError(f"quantity must be positive, got {qty}")
        have = self._stock.get(sku, 0)
        if qty > have:
            raise ValueError(f"cannot remove {qty} of {sku!r}: only {have} in stock")
        if qty == have:
            del self._stock[sku]
        else:
            self._stock[sku] = have - qty
        return have - qty

    def count(self, sku: str) -> int:
        return self._stock.get(sku, 0)

    def skus(self) -> list[str]:
        """The SKUs in stock, sorted."""
        return sorted(self._stock)

    def low_stock(self, threshold: int) -> list[tuple[str, int]]:
        """``(sku, level)`` for SKUs at or below ``threshold``, lowest level first, ties by SKU."""
        low = [(sku, n) for sku, n in self._stock.items() if n <= threshold]
        return sorted(low, key=lambda item: (item[1], item[0]))
