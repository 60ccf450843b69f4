"""`optimizer_memory: host`: the optimizer state stays in pinned host memory between steps and comes to the
device for the update, one parameter array at a time. A run trains to the same numbers as with the state on
the device, resumes from its checkpoints (and from a device run's), and `meshlm plan` counts the state as
host memory.

The oracle of every run here is the same run with `optimizer_memory: device`. Moving an array between memory
kinds copies its bytes, and the update is the same arithmetic on the same values, but done array by array
XLA fuses it otherwise (the global-norm clip's scale into Adam's moments: a multiply-add contracted or not),
so the two agree to float32 roundoff, not bit for bit. The runs use `smooth` Adam (eps 1): with eps 1e-8 an
early update is about lr x sign(g), and roundoff can flip the sign of a gradient near 0."""

import importlib.util
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from meshlm import planner, train, train_step
from meshlm.config import ConfigError, TrainConfig, preset
from meshlm.sharding import make_mesh
from tests.helpers.training import SEQ, smooth, tiny_config, write_dataset

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
MESH = "data=2,fsdp=2,model=2"
LORA = {"rank": 4, "alpha": 8.0, "targets": ["q", "v", "fc_in"]}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    rows = np.random.default_rng(0).integers(1, 256, (64, SEQ + 1))
    return write_dataset(tmp_path_factory.mktemp("optimizer_memory_data"), rows)


def run(dataset, out_dir, **changes) -> train.TrainResult:
    cfg = smooth(tiny_config(dataset, out_dir, **{"mesh": MESH, "total_steps": 4, **changes}))
    return train.train(cfg, progress=False, sample=False)


def assert_same_run(got: train.TrainResult, want: train.TrainResult) -> None:
    assert list(got.losses) == [3, 4]  # the resumed run's steps
    np.testing.assert_allclose(list(got.losses.values()), [want.losses[3], want.losses[4]], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got.lm.params), jax.tree.leaves(want.lm.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5 * np.abs(b).max())


def memory_kinds(tree) -> set[str]:
    return {s.memory_kind for s in jax.tree.leaves(tree)}


@pytest.mark.slow
@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_a_run_with_the_state_on_the_host_trains_and_resumes_as_the_device_run(lora, dataset, tmp_path):
    """On a data x fsdp x model mesh: four steps with the state on the device; the same run on the host stopped
    after two and resumed from its checkpoint; and the device run's two-step checkpoint resumed on the host.
    A LoRA run's state (the adapter's alone) goes the same way."""
    want = run(dataset, tmp_path / "device", lora=lora)
    run(dataset, tmp_path / "host", lora=lora, optimizer_memory="host", total_steps=2)
    resumed = run(dataset, tmp_path / "host", lora=lora, optimizer_memory="host")
    assert_same_run(resumed, want)
    run(dataset, tmp_path / "switched", lora=lora, total_steps=2)
    switched = run(dataset, tmp_path / "switched", lora=lora, optimizer_memory="host")
    assert_same_run(switched, want)


@pytest.mark.slow
@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_the_compiled_step_takes_and_returns_the_state_in_host_memory(lora, dataset, tmp_path):
    """The compiled program's own shardings: the optimizer state in and out in pinned host memory; the trained
    parameters, the batch and a LoRA run's frozen base on the device. The config is `run`'s (smooth Adam, which
    changes no sharding): these are the very programs the runs above compiled, loaded from the session's
    persistent compilation cache rather than compiled again (tests/conftest.py)."""
    cfg = smooth(tiny_config(dataset, tmp_path, mesh=MESH, lora=lora, optimizer_memory="host", total_steps=4))
    program = train_step.step_program(cfg, cfg.model, make_mesh(MESH), SEQ)
    compiled = program.compile()
    (state_in, *others), _ = compiled.input_shardings
    state_out, _ = compiled.output_shardings
    for state in (state_in, state_out):
        assert memory_kinds(state.opt_state) == {train_step.HOST_MEMORY}
        assert memory_kinds((state.step, state.params)) == {"device"}
    assert memory_kinds(others) == {"device"}  # the batch, and a LoRA run's base
    device = train_step.step_program(cfg.replace(optimizer_memory="device"), cfg.model, make_mesh(MESH), SEQ)
    assert memory_kinds(device.compile().input_shardings[0][0].opt_state) == {"device"}


def test_bad_settings_and_devices_without_host_memory_give_one_line():
    with pytest.raises(ConfigError, match=r"optimizer_memory must be one of \['device', 'host'\], got 'cpu'"):
        TrainConfig(optimizer_memory="cpu")
    device = SimpleNamespace(platform="gpu", addressable_memories=lambda: [SimpleNamespace(kind="device")])
    mesh = SimpleNamespace(devices=np.array([device]))
    with pytest.raises(ConfigError, match="gpu devices have no pinned_host memory") as e:
        train_step.check_host_memory(mesh)
    assert len(str(e.value).splitlines()) == 1


def test_the_gpu_estimate_counts_the_state_as_host_memory():
    """Off the device between steps; on it, whole, while the update runs after the activations are freed."""
    cfg = TrainConfig(model=preset("gptj-1b"), seq_len=2048, remat="full", compute_dtype="bfloat16")

    def fits(batch_size: int) -> tuple[planner.TrainFit, planner.TrainFit]:
        return tuple(
            planner.plan_train(
                cfg.replace(batch_size=batch_size, optimizer_memory=m), "gpu:h100-80gb", mesh="data=1", search=False
            ).config
            for m in ("device", "host")
        )

    device, host = fits(16)
    assert (device.host, host.host) == (0, host.optimizer) and host.optimizer_on_host
    assert host.device_optimizer == 0 and device.device_optimizer == device.optimizer > 0
    assert device.total - host.total == device.optimizer  # the activations outweigh the update: the state is saved
    device, host = fits(1)
    assert host.total == device.total  # activations under one gradient: the update's peak holds what was saved


def test_a_cpu_plan_names_the_host_state_and_counts_it_with_the_device(dataset, tmp_path):
    """A CPU device's memory is the host's: its compiler counts the pinned host state in the total. The plan is of
    the full run's step above (its config and mesh): in the whole suite its program comes from the persistent
    compilation cache."""
    cfg = smooth(tiny_config(dataset, tmp_path, mesh=MESH, optimizer_memory="host", total_steps=4))
    plan = planner.plan_train(cfg, "cpu", search=False)
    assert not plan.config.optimizer_on_host and plan.config.host == 0
    text = planner.describe_train(plan, cfg)
    assert "adam float32 in host memory" in text
    assert "host memory per device" in text and "counted in the total above" in text


@pytest.mark.slow
@pytest.mark.skipif(not HAS_LIBTPU, reason="TPU targets compile with libtpu (pip install 'meshlm[tpu]')")
def test_a_tpu_plan_moves_the_state_from_device_to_host_memory():
    """XLA's own figures for a v5e chip: the device's arguments lose the state's bytes, which its host memory
    holds; `meshlm plan` reports them there, outside the device total."""
    # 8 x 256 (4 x 512 compiled twice as long, with the same figures to 0.3 MB)
    cfg = TrainConfig(model=preset("gptj-tiny"), batch_size=8, seq_len=256, remat="full", attention="xla")
    fits = {
        m: planner.plan_train(cfg.replace(optimizer_memory=m), "tpu:v5e:2x2", mesh="fsdp=4", search=False).config
        for m in ("device", "host")
    }
    device, host = fits["device"], fits["host"]
    assert device.compiled.host == device.host == 0
    assert device.compiled.arguments - host.compiled.arguments == host.compiled.host == host.host
    assert host.optimizer <= host.host < 1.05 * host.optimizer  # the chip's tiles pad the small arrays
    assert host.total < device.total  # this step's activations outweigh the state while it is updated
    plan = planner.TrainPlan(planner.target("tpu:v5e:2x2"), "fsdp=4", 256, host, None)
    text = planner.describe_train(plan, cfg.replace(optimizer_memory="host"))
    assert "optimizer state             0.00 GiB (in host memory: below)" in text
    assert "host memory per device (pinned; the step reads and writes it there):\n  optimizer state" in text
    assert "offloaded activations" not in text  # the remat policy offloads none
