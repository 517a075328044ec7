"""ledger: money as integer cents, stock levels, and account balances."""

from ledger.accounts import InsufficientFunds, Ledger
from ledger.inventory import Inventory
from ledger.money import format_amount, parse_amount

__all__ = ["InsufficientFunds", "Inventory", "Ledger", "format_amount", "parse_amount"]
