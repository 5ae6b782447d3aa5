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
    assert p.resources(0) == {"num_cpus": 1.0, "num_gpus": 0}
    assert p.device(0) is None  # no GPU resources: MLX keeps its default (a Mac's Metal GPU)
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
    assert cpu.device(0) == "cpu"  # GPUs in the cluster but none reserved: keep off them
    with pytest.raises(ValueError, match="cluster has 0 GPUs"):
        plan_actors(0, None, 1)
    with pytest.raises(ValueError):
        plan_actors(2, 0, None)


def test_local_gpus_follows_cuda_visible_devices(monkeypatch):
    from pipeline.run.ray_resources import local_gpus

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,3")
    assert local_gpus() == 3
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert local_gpus() == 0


class _FakeRay:
    """Just what RayRun's planning and actor factory call."""

    def __init__(self, resources):
        self.resources, self.made = resources, []

    def cluster_resources(self):
        return self.resources

    def put(self, x):
        return x

    def remote(self, **options):
        def wrap(cls):
            fake = self

            class Handle:
                @staticmethod
                def remote(job, **kw):
                    fake.made.append((options, kw["device"]))
                    return len(fake.made)

            return Handle

        return wrap


def test_ray_run_asks_one_gpu_per_actor(monkeypatch):
    import sys
    from types import SimpleNamespace

    from pipeline.run import ray_engine

    fake = _FakeRay({"CPU": 16, "GPU": 4})
    monkeypatch.setitem(sys.modules, "ray", fake)
    spec = SimpleNamespace(address=None, workers=None, gpus_per_worker=None, max_retries=0,
                           max_in_flight_per_worker=1)
    run = ray_engine.RayRun(SimpleNamespace(spec=SimpleNamespace(engine=spec)), workers=6)
    run.plan = ray_engine._plan(None, run.workers_asked, run.gpus_per_worker, run.num_cpus)
    make = run._actor_factory()
    for i in range(run.plan.workers):
        make(i)
    assert [(o["num_gpus"], d) for o, d in fake.made] == [(1.0, "gpu")] * 4 + [(0, "cpu")] * 2
    assert all(o["num_cpus"] == 1.0 and o["max_restarts"] == 0 for o, _ in fake.made)
    fake.resources = {"CPU": 3, "GPU": 4}  # 4 GPU actors need 4 CPUs
    with pytest.raises(Exception, match="has 3 CPUs.*4 GPU actors"):
        ray_engine._plan("auto", None, None, 1.0)
