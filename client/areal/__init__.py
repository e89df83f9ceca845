"""expbuf from AReaL: its trajectory rows as TRXP experiences (`to_areal`, `from_areal`)."""

from .convert import TOKEN_VERSIONS, from_areal, to_areal

__all__ = ["TOKEN_VERSIONS", "from_areal", "to_areal"]
