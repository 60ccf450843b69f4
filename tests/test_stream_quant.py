"""Loading and initialising a quantized base streams: each projection is made one layer at a time into
its quantized stack, and the result is exactly the whole model made in float, then quantized."""

import jax
import numpy as np
import pytest

import meshlm
from meshlm import model, quant
from meshlm.formats import slices
from meshlm.param import Param, init_layer, init_leaf
from meshlm.sharding import make_mesh

CFG = meshlm.ModelConfig(
    vocab_size=128, n_vocab_used=120, d_model=128, n_layer=3, n_head=4, d_ff=256, rotary_dim=8, max_seq_len=64
)


def _equal_trees(a, b):
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(leaves_a, leaves_b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_stacked_parameter_is_drawn_layer_by_layer_so_one_layer_can_be_made_alone():
    p = Param((4, 8, 16), ("layers", "embed", "mlp"), "normal", 0.02)
    key = jax.random.key(5)
    whole = np.asarray(init_leaf(p, key, "float32"))
    for i in range(4):
        np.testing.assert_array_equal(np.asarray(init_layer(p, key, i, "float32")), whole[i])
    assert whole.std() == pytest.approx(0.02, rel=0.1)
    assert not np.array_equal(whole[0], whole[1])


@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_quantizing_a_stack_layer_by_layer_equals_quantizing_it_whole(kind):
    w = jax.random.normal(jax.random.key(0), (3, 64, 4, 16))
    whole = quant.quantize(w, kind, 1)
    stack = jax.tree.map(np.zeros_like, whole)
    for i in range(3):
        stack = quant.quantize_into(stack, w[i], i, kind, 1)
    _equal_trees(stack, whole)


@pytest.mark.bitwise_across_programs  # `slow` in a process of its own (conftest.py)
@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_a_streamed_quantized_init_equals_the_float_init_quantized(kind):
    mesh = "data=-1,model=2"
    streamed = meshlm.from_config(CFG, mesh=mesh, seed=7, quantize=kind)
    full = jax.jit(lambda k: model.init(CFG, k, "float32"))(jax.random.key(7))
    expected = quant.quantize_projections(full, model.PROJECTION_PATHS, kind)
    _equal_trees(streamed.params, expected)
    # the float model's values are the same draw
    _equal_trees(meshlm.from_config(CFG, mesh=mesh, seed=7).params, full)
    q = jax.tree.leaves(model.projection(streamed.params, "q"))[0]
    assert "model" in q.sharding.spec  # laid out on the mesh as the quantized axes say


def test_a_float_model_made_stack_by_stack_equals_the_one_program_init(monkeypatch):
    """Stacks over `STREAM_BYTES` in float32 (GPT-J-6B's, in bf16 on a 16 GiB chip) are made layer by layer."""
    from meshlm import api

    full = jax.jit(lambda k: model.init(CFG, k, "bfloat16"))(jax.random.key(4))
    monkeypatch.setattr(api, "STREAM_BYTES", 0)
    streamed = meshlm.from_config(CFG, mesh="data=-1,model=2", dtype="bfloat16", seed=4)
    _equal_trees(streamed.params, full)


@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_placing_a_quantized_base_from_slices_streams_layers_and_equals_quantizing_it_whole(kind):
    full = jax.tree.map(np.asarray, model.init(CFG, jax.random.key(2), "float32"))
    arrays = {model.param_name(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(full)[0]}
    reads = []

    def source(name, shape):
        def read(index):
            reads.append((name, index))
            return arrays[name][index]

        return read

    placed = slices.place(CFG, source, make_mesh("data=-1,model=2"), "float32", kind)
    _equal_trees(placed, quant.quantize_projections(full, model.PROJECTION_PATHS, kind))
    fc_in = [index for name, index in reads if name == "layers.mlp.fc_in.w"]
    assert fc_in and all(index[0].stop - index[0].start == 1 for index in fc_in)  # never more than one layer


def _fill_one_layer_temp_bytes(n_layer, kind):
    """XLA's temporaries for the program that makes and quantizes one layer of fc_in of an n_layer model."""
    cfg = meshlm.ModelConfig(
        vocab_size=128, n_vocab_used=120, d_model=256, n_layer=n_layer, n_head=4, d_ff=1024, rotary_dim=8
    )
    p = model.projection(model.param_table(cfg), "fc_in")
    abstract = model.projection(model.abstract_params(cfg, "float32", kind), "fc_in")
    replicated = jax.sharding.NamedSharding(make_mesh("data=-1"), jax.sharding.PartitionSpec())
    sharding = jax.tree.map(lambda _: replicated, abstract)
    step = slices.layer_step(kind, 1, sharding, lambda k, i: init_layer(p, k, i, "float32"))
    return step.lower(abstract, 0, jax.random.key(0)).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_the_program_that_fills_one_layer_needs_temporaries_of_one_layer_whatever_the_depth(kind):
    """The peak of streaming is the quantized stack (donated, updated in place) plus one layer's float
    draw and its quantization: XLA's own figures do not grow with the number of layers, and stay under
    the float stack's size (CPU's compiler fuses less than a TPU's, hence the slack of a few layers)."""
    layer_bytes = 256 * 1024 * 4  # one layer of fc_in in float32
    shallow, deep = _fill_one_layer_temp_bytes(4, kind), _fill_one_layer_temp_bytes(32, kind)
    assert deep == shallow
    assert deep <= 8 * layer_bytes < 32 * layer_bytes


@pytest.mark.slow  # four train steps compiled on a tiny model: about a minute on a CPU
def test_the_gptj6b_benchmark_runs_its_cases_on_a_tiny_model(tmp_path):
    import json

    from benchmarks import gptj6b_tpu

    folder = tmp_path / "hf"  # the user's path: every base loaded from a Hugging Face folder the script writes
    argv = ["--model", "test-tiny", "--seq-len", "32", "--batches", "2", "--steps", "1", "--out", str(tmp_path)]
    report = gptj6b_tpu.main([*argv, "--folder", str(folder)])
    assert (folder / "config.json").exists() and report["folder"] == str(folder)
    assert set(report["cases"]) == set(gptj6b_tpu.CASES)
    for name, case in report["cases"].items():
        assert case["status"] == "ok", (name, case)
        assert case["tokens_per_s"] > 0 and 0 < case["mfu"] and case["step_s"] > 0
    assert json.loads((tmp_path / "gptj6b.json").read_text())["machine"]["jax"] == jax.__version__
    assert "JAX" in (tmp_path / "gptj6b.md").read_text()
