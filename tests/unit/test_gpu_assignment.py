"""Which GPUs each rank sees: torch and Horovod scripts pick ``cuda:LOCAL_RANK``, TF workers
and MIG instances need one device each."""

from __future__ import annotations

import pytest

from dlrun.inventory import parse_inline
from dlrun.plan import make_plan
from dlrun.render import worker_commands

GPUS = ["GPU-a", "GPU-b", "GPU-c", "GPU-d"]


def visible(framework: str, devices: list[str], slots: int = 4, env: str = "") -> list[str | None]:
    plan = make_plan(parse_inline(f"h:{slots}"), job_id="j", framework=framework)
    extra = dict([env.split("=", 1)]) if env else None
    commands = worker_commands(plan, "t.py", [], python_for={"h": ["p"]}, gpus_for={"h": devices},
                               extra_env=extra, rendezvous=("h", 1))
    return [c.env.get("CUDA_VISIBLE_DEVICES") for c in commands]


@pytest.mark.parametrize("framework", ["torch", "horovod"])
def test_torch_and_horovod_ranks_see_the_hosts_gpus_so_local_rank_indexes_theirs(framework: str) -> None:
    seen = visible(framework, GPUS)
    assert seen == ["GPU-a,GPU-b,GPU-c,GPU-d"] * 4
    for local_rank, value in enumerate(seen):
        assert value is not None and value.split(",")[local_rank] == GPUS[local_rank]


def test_a_job_using_fewer_ranks_than_gpus_shows_only_its_own() -> None:
    assert visible("torch", GPUS, slots=2) == ["GPU-a,GPU-b"] * 2


@pytest.mark.parametrize("framework", ["tf", "none"])
def test_tf_workers_get_one_gpu_each(framework: str) -> None:
    seen = visible(framework, GPUS)
    assert seen == GPUS and len(set(seen)) == 4


def test_mig_instances_are_pinned_per_rank_even_for_torch() -> None:
    migs = ["MIG-1", "MIG-2"]
    assert visible("torch", migs, slots=2) == migs


def test_a_value_the_user_set_wins() -> None:
    assert visible("torch", GPUS, env="CUDA_VISIBLE_DEVICES=3") == ["3"] * 4
