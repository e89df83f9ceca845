"""expbuf client side: the TRXP codec and experience types shared with the server."""

from .experience import EID, Experience
from .trxp import TrxpError, decode, encode

__all__ = ["EID", "Experience", "TrxpError", "decode", "encode"]
