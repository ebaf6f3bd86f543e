"""What the tests of one pytest session share across processes."""

import atexit
import functools
import shutil
import tempfile


@functools.cache
def cache_dir() -> str:
    """partita's measurement cache (PARTITA_CACHE_DIR) for every job the tests start, the pools' and the launched
    ones alike: block costs, the links between ranks and partita's own costs per step are measured once per model
    and world size, by whichever job comes first, as a user's later runs on one machine find them. Made at the
    first call (in the session's process, not in each pool worker that imports its module) and removed at exit."""
    path = tempfile.mkdtemp(prefix="partita-test-cache-")
    atexit.register(shutil.rmtree, path, True)
    return path
