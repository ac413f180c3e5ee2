"""One base class for errors a user can fix (a bad path, a refused directory, a mismatched
checkpoint). The console script prints `error: <message>` and exits 2 on any of them; other
exceptions are bugs and keep their traceback. SPECREPLAY_DEBUG=1 shows the traceback always.
"""

from __future__ import annotations


class UserError(ValueError):
    """Bad input. The message names the file or field and says what to do. A ValueError, so
    library callers that catch ValueError for bad arguments keep working."""
