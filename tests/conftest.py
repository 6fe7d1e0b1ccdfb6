"""The test session's shared pools of live ranks (``tests._dist.run_ranks``), its background launches
(``tests._background``) and its command server (``tests._commands``), closed when the session ends.

Spawning ranks and importing torch dominate a multi-rank test; the pools pay for it once per world size.
"""

from __future__ import annotations

import atexit
from collections.abc import Iterator

import pytest

from tests._background import Chain
from tests._commands import CommandServer, use_commands
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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests that read background launches run last, so that the launches overlap the rest of the suite."""
    from tests.hf_scripts.launches import STAGES, used_by
    from tests.zoo_sweeps import READERS

    items.sort(key=lambda item: bool(used_by([item]) & (STAGES | READERS)))  # stable: file order otherwise


@pytest.fixture(scope="session", autouse=True)
def launches(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chain]:
    """The launches the selected tests read, started now and run in the background (Note [background launches])."""
    from tests import zoo_sweeps
    from tests.hf_scripts.launches import stages, used_by

    paths = {name: tmp_path_factory.mktemp(name) for name in ("hf", "examples", "sft_example", zoo_sweeps.ZOO_STAGE)}
    used = used_by(request.session.items)
    hf = stages(used, paths["hf"], paths["examples"], paths["sft_example"])
    chain = Chain([*zoo_sweeps.stages(used, paths[zoo_sweeps.ZOO_STAGE]), *hf], paths).start()
    atexit.register(chain.close)
    yield chain
    chain.close()
    atexit.unregister(chain.close)


@pytest.fixture(scope="session", autouse=True)
def commands() -> Iterator[CommandServer]:
    """The session's command server: ``seqpar`` commands forked from one import (Note [forked commands])."""
    server = CommandServer()
    atexit.register(server.close)
    use_commands(server)
    yield server
    use_commands(None)
    server.close()
    atexit.unregister(server.close)
