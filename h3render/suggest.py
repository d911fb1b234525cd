"""One wording for a name a manifest does not know, wherever it stands: a job's field (`sed`) or a key of a list
entry (`loras[0].strenght`). Both say ``unknown field (did you mean seed?)`` with difflib's closest known name, or
list the known names when none is close; a fresh-user trial found the list entries saying "unknown key" with no
suggestion where the job's fields suggested one. Torch-free."""

from __future__ import annotations

import difflib
from typing import Sequence


def unknown_field(name: str, allowed: Sequence[str]) -> str:
    """``unknown field (did you mean strength?)``, else ``unknown field; allowed: path, strength, schedule``."""
    close = difflib.get_close_matches(str(name), allowed, n=1)
    return f"unknown field (did you mean {close[0]}?)" if close else f"unknown field; allowed: {', '.join(allowed)}"
