"""Ray actor plan: one actor per GPU by default, CPU actors elsewhere."""

import pytest

from pipeline.run.ray_resources import DEFAULT_CPU_WORKERS, plan_actors


def test_one_actor_per_gpu_by_default():
    p = plan_actors(8, None, None)
    assert (p.gpu_actors, p.cpu_actors, p.num_gpus) == (8, 0, 1.0)
    assert p.resources(0) == {"num_cpus": 1.0, "num_gpus": 1.0} and p.device(7) == "gpu"


def test_cpu_actors_where_there_are_no_gpus():
    p = plan_actors(0, None, None)
    assert (p.gpu_actors, p.cpu_actors) == (0, DEFAULT_CPU_WORKERS)
    assert p.resources(0) == {"num_cpus": 1.0, "num_gpus": 0} and p.device(0) == "cpu"
    assert plan_actors(0, 5, None).workers == 5


def test_more_workers_than_gpus_adds_cpu_actors():
    p = plan_actors(2, 5, None)
    assert (p.gpu_actors, p.cpu_actors) == (2, 3)
    assert [p.device(i) for i in range(5)] == ["gpu", "gpu", "cpu", "cpu", "cpu"]
    assert p.resources(4)["num_gpus"] == 0
    assert plan_actors(4, 2, None).workers == 2  # fewer asked: fewer GPU actors


def test_gpu_share_override():
    half = plan_actors(2, None, 0.5)
    assert (half.gpu_actors, half.num_gpus) == (4, 0.5)
    cpu = plan_actors(8, 3, 0)
    assert (cpu.gpu_actors, cpu.cpu_actors) == (0, 3)
    with pytest.raises(ValueError, match="cluster has 0 GPUs"):
        plan_actors(0, None, 1)
    with pytest.raises(ValueError):
        plan_actors(2, 0, None)
