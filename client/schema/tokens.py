"""A bearer token as both sides read it: the clients send it in an `authorization: Bearer TOKEN`
header, and the server keys its tokens' scopes by it."""

from __future__ import annotations


def bearer_token(token: str) -> str:
    """`token` without its surrounding whitespace (a secret read from a file ends in a newline,
    which no client could send); one holding a character an authorization header cannot carry is
    a ValueError saying so, never showing the token (a secret)."""
    token = token.strip()
    if any(not " " < char <= "~" for char in token):
        raise ValueError(
            "token holds a space, a control or a non-ASCII character, which its authorization header cannot carry;"
            " a token is printable ASCII"
        )
    return token
