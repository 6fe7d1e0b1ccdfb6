"""The test session's shared pools of live ranks (``tests._dist.run_ranks``), closed when the session ends.

Spawning ranks and importing torch dominate a multi-rank test; the pools pay for it once per world size.
"""

from __future__ import annotations

import atexit
from collections.abc import Iterator

import pytest

from tests._dist import RankPools, use_pools


@pytest.fixture(scope="session", autouse=True)
def rank_pools() -> Iterator[RankPools]:
    """The session's pools: ``run_ranks`` uses them for every gloo call that does not ask for fresh ranks."""
    pools = RankPools()
    atexit.register(pools.close)  # also when the session dies before its teardown runs
    use_pools(pools)
    yield pools
    use_pools(None)
    pools.close()
    atexit.unregister(pools.close)
