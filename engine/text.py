"""Token pieces for display and an incremental detokenizer for the committed answer prefix.

Byte-level BPE tokens may hold part of a UTF-8 character; text is emitted only once it is whole,
and each step decodes only the new tokens (the reference re-decoded the whole answer every step).
"""
from __future__ import annotations

import codecs
from functools import lru_cache


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: the printable stand-ins byte-level BPE uses."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class TokenBytes:
    """token id -> raw bytes, for byte-level BPE vocabularies (Qwen2, SmolLM2); falls back to decode()."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self._cache: dict[int, bytes] = {}
        dec = _byte_decoder()
        self._dec = dec

    def __call__(self, token_id: int) -> bytes:
        b = self._cache.get(token_id)
        if b is None:
            piece = self.tok.convert_ids_to_tokens(int(token_id))
            if piece is None:
                b = b""
            elif token_id in self.special or any(ch not in self._dec for ch in piece):
                b = self.tok.decode([int(token_id)], skip_special_tokens=False).encode("utf-8")
            else:
                b = bytes(self._dec[ch] for ch in piece)
            self._cache[token_id] = b
        return b

    def piece(self, token_id: int) -> str:
        """A display label for one token: partial UTF-8 bytes shown as <0xNN>."""
        b = self(token_id)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            out, i = [], 0
            while i < len(b):
                for j in range(min(len(b), i + 4), i, -1):
                    try:
                        out.append(b[i:j].decode("utf-8"))
                        i = j
                        break
                    except UnicodeDecodeError:
                        continue
                else:
                    out.append(f"<0x{b[i]:02X}>")
                    i += 1
            return "".join(out)


class IncrementalDetokenizer:
    """Feed the answer's contiguous committed tokens in order; get back only the new, whole text."""

    def __init__(self, token_bytes: TokenBytes, skip_ids: set[int] | None = None):
        self.tb = token_bytes
        self.skip = skip_ids or set()
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""

    def push(self, token_id: int) -> str:
        if token_id in self.skip:
            return ""
        delta = self.decoder.decode(self.tb(token_id))
        self.text += delta
        return delta

    def flush(self) -> str:
        delta = self.decoder.decode(b"", final=True)
        self.text += delta
        return delta
