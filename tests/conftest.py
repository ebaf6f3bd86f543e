import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT / "tests", ROOT / "examples", ROOT / "src"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))
# the pools' forkserver imports partita as it starts, from the environment's path (Python 3.11 ignores the sys.path
# it is handed): this tree's, not the one an editable install elsewhere points to
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# a job switches layouts when its measured steps show another faster: on a loaded machine that would happen at
# random in runs that compare results over many steps; the tests of switching turn it on (layout_switch)
os.environ.setdefault("PARTITA_SWITCH_LAYOUT", "off")


# per test module: a pool's ranks keep every process group its cases made, each with transport threads that
# poll; kept for the whole session they loaded the machine under the launcher tests that run after them
@pytest.fixture(scope="module")
def pools():
    from support.pool import Pools

    p = Pools()
    yield p
    p.close()
