"""Who may act on the web page: the operator token, the signed session cookie and CSRF.

A script sends `Authorization: Bearer <token>`. A browser posts the token once to the
login form and gets a session cookie (HttpOnly, SameSite=Strict, Secure over HTTPS)
holding a random nonce, a flag with the name the operator gave (the audit trail's), and
the time, signed with HMAC-SHA256 under a key derived
from the token: rotating the token ends every session, and the cookie never carries the
token. Every form carries a CSRF token, the HMAC of the session's nonce, checked on POST.
Every comparison is of bytes (`same`): a cookie or form field with non-ASCII text is a
mismatch, never an error.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass
from typing import Literal

COOKIE = "darkroom_session"
SESSION_MAX_AGE_S = 12 * 3600
# Domain separation: the signing key is not the token, and serves this one purpose.
KEY_LABEL = b"darkroom web session v1"

Verdict = Literal["ok", "none", "wrong"]
# Who a session acts as in the audit trail when the login form named no one.
DEFAULT_NAME = "operator"
NAME_MAX_CHARS = 200


@dataclass(frozen=True)
class Session:
    nonce: str
    operator: bool
    issued_s: int
    name: str = DEFAULT_NAME


def clean_name(raw: object) -> str:
    """The login form's name: printable, at most NAME_MAX_CHARS, else DEFAULT_NAME."""
    name = str(raw or "").strip()
    ok = 0 < len(name) <= NAME_MAX_CHARS and name.isprintable()
    return name if ok else DEFAULT_NAME


def _flag(operator: bool, name: str) -> str:
    """`0`, or `1~` and the name in base64url (no dot, so the cookie still splits in 4)."""
    return f"1~{_b64(_utf8(name))}" if operator else "0"


def _unflag(flag: str) -> tuple[bool, str]:
    """Also reads the plain `1` of a cookie signed before sessions carried a name."""
    mark, _, encoded = flag.partition("~")
    if mark != "1":
        return False, DEFAULT_NAME
    try:
        name = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode()
    except (binascii.Error, UnicodeDecodeError):
        return True, DEFAULT_NAME
    return True, clean_name(name)


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")  # any text encodes, lone surrogates too


def same(candidate: str, expected: str) -> bool:
    """Constant-time equality of two texts, whatever they hold: compare_digest refuses
    non-ASCII `str`, so both are compared as bytes."""
    return hmac.compare_digest(_utf8(candidate), _utf8(expected))


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


class Auth:
    """The token (None: the page is read-only) and everything signed with it."""

    def __init__(self, token: str | None) -> None:
        self.token = token
        self._key = hmac.new(token.encode(), KEY_LABEL, hashlib.sha256).digest() if token else b""

    @property
    def enabled(self) -> bool:
        return self.token is not None

    def _sign(self, payload: str) -> str:
        return _b64(hmac.new(self._key, _utf8(payload), hashlib.sha256).digest())

    def token_matches(self, candidate: str) -> bool:
        if self.token is None:
            return False
        return same(candidate, self.token)

    def bearer(self, header: str | None) -> Verdict:
        """`none` without an Authorization header, `ok` for the token, else `wrong`."""
        if not header:
            return "none"
        scheme, _, value = header.partition(" ")
        ok = scheme.lower() == "bearer" and self.token_matches(value.strip())
        return "ok" if ok else "wrong"

    def new_session(self, operator: bool, name: str = DEFAULT_NAME) -> tuple[Session, str]:
        """A fresh nonce each time (a login never reuses the anonymous session's)."""
        name = clean_name(name) if operator else DEFAULT_NAME
        session = Session(secrets.token_urlsafe(16), operator, int(time.time()), name)
        payload = f"{session.nonce}.{_flag(operator, name)}.{session.issued_s}"
        return session, f"{payload}.{self._sign(payload)}"

    def read_session(self, cookie: str | None) -> Session | None:
        """The session if the cookie is ours, intact and younger than SESSION_MAX_AGE_S."""
        if not cookie or not self.enabled or cookie.count(".") != 3:
            return None
        nonce, operator, issued, signature = cookie.split(".")
        if not same(signature, self._sign(f"{nonce}.{operator}.{issued}")):
            return None
        if (
            not (issued.isascii() and issued.isdigit())
            or time.time() - int(issued) > SESSION_MAX_AGE_S
        ):
            return None
        is_operator, name = _unflag(operator)
        return Session(nonce, is_operator, int(issued), name)

    def csrf_token(self, session: Session) -> str:
        return self._sign(f"csrf:{session.nonce}")

    def csrf_ok(self, session: Session, candidate: object) -> bool:
        return isinstance(candidate, str) and same(candidate, self.csrf_token(session))
