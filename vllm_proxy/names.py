"""Which names of models, aliases and adapters can travel to HAProxy.

`vllm-proxy-fleet` writes every name a request may give into HAProxy's map, on its runtime API
(one command per line, split at `;` and at blanks, ``\\`` an escape) and in its map file (one
``name server`` per line, a line that begins with ``#`` a comment, lines cut at HAProxy's
buffer). A name with any of those characters would split a command (a ``del map`` of another
model's entry) or a line of the file (another model routed to the wrong server after a restart):
the proxy refuses such names in its config and in adapter folders, and the fleet leaves them
out of the map whatever a neighbour says.
"""

from __future__ import annotations

import functools
import re
import unicodedata

#: The longest name a model, alias or adapter may have (characters). HAProxy reads a map file
#: line and a runtime API command into one buffer (``tune.bufsize``, 16 KiB by default).
NAME_MAX = 256
#: Characters HAProxy's runtime API or map file give a meaning to.
SPECIAL = frozenset(";#\\")
#: Printable ASCII but blanks and `SPECIAL`: the common case, checked at once.
_PLAIN = re.compile(r"[!-\"$-:<-\[\]-~]+")


def name_problem(name: str) -> str | None:
    """Why `name` cannot be carried to HAProxy, or None when it can."""
    if len(name) > NAME_MAX:
        return f"longer than {NAME_MAX} characters"
    return _problem(name)


@functools.lru_cache(maxsize=65536)
def _problem(name: str) -> str | None:
    """(Kept for the names seen last, at most `NAME_MAX` characters each: the fleet checks
    every name of every server each round.)"""
    if _PLAIN.fullmatch(name):
        return None
    if not name:
        return "empty"
    for c in name:
        if c in SPECIAL:
            return f"holds {c!r} (HAProxy's command line and map file give it a meaning)"
        if c.isspace():
            return f"holds white space {c!r}"
        if unicodedata.category(c) in ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"):
            return f"holds the control or unassigned character U+{ord(c):04X}"
    return None


def carriable(name: str) -> bool:
    """Whether `name` can be a key of HAProxy's map (see `name_problem`)."""
    return name_problem(name) is None
